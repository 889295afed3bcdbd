// `dgr-worker --probe HOST:PORT`: a health check of a worker (grpc.health.v1 Check of the whole server), as
// a container's exec probe runs it where the kubelet's own gRPC probe cannot present a member certificate.
#pragma once

#include <string>

#include "tls.h"

namespace dgr {

// Asks the worker at `address`; with TLS files, presents them and checks the worker's certificate against
// the CA under the first host the given certificate is issued for (a pod probes itself through 127.0.0.1,
// and its certificate names the pod). Prints SERVING and returns 0, else prints what it got and returns 1.
int probe_health(const std::string & address, const TlsFiles & files, double timeout_s);

}  // namespace dgr
