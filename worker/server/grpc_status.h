// gRPC's status codes by name (UNAVAILABLE, RESOURCE_EXHAUSTED, ...), as Python's grpc.StatusCode names them:
// what the worker's logs and errors say about a call or a stream that ended.
#pragma once

#include <string>

#include <grpcpp/support/status.h>

namespace dgr {

inline std::string status_name(grpc::StatusCode c) {
    static const char * names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                   "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                   "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                   "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
    int i = int(c);
    return i >= 0 && i < int(sizeof names / sizeof *names) ? names[i] : std::to_string(i);
}

}  // namespace dgr
