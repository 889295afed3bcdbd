// The descriptor guard: gRPC's listener never meets EMFILE (listen_guard.cpp says why and how). listen.cpp's
// raise_open_files sets the limit and keeps room for the margin; serve() hands the builder the option and arms the
// guard once the port is bound.
#pragma once

#include <grpcpp/impl/server_builder_option.h>

#include <cstdint>
#include <memory>

namespace dgr::serve {

int guard_margin_for(int64_t limit);             // descriptors the guard keeps free below the open-files limit
void guard_set_limit(int64_t limit);             // the limit in force
std::unique_ptr<grpc::ServerBuilderOption> guard_option();   // every accepted connection passes the guard first
void guard_arm(int port);                        // after the server started listening on `port`

}  // namespace dgr::serve
