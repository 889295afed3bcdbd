// What the Stage service's handlers share (rpc/*.cpp): the guard every handler runs in.
#pragma once

#include <grpcpp/grpcpp.h>

#include <exception>
#include <string>

namespace dgr {

// Every handler runs inside this: no exception leaves a gRPC handler (INTERNAL with its message).
template <typename F> grpc::Status guarded(const char * rpc, F && f) {
    try {
        return f();
    } catch (const std::exception & e) {
        return grpc::Status(grpc::StatusCode::INTERNAL, std::string(rpc) + " failed: " + e.what());
    } catch (...) {
        return grpc::Status(grpc::StatusCode::INTERNAL, std::string(rpc) + " failed (unknown exception)");
    }
}

}  // namespace dgr
