// TLS and mutual TLS for dgr-worker (docs/worker.md, docs/security.md): `--tls-cert --tls-key [--tls-ca]`,
// the rules the client's dgr.runtime.wire.tls follows too, on the listener and every outgoing link.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>
#include <string>

namespace dgr {

// This side's certificate and key, and optionally the operator's CA (then peers must present a
// certificate it signed: mutual TLS). Empty cert and key: plaintext.
struct TlsFiles {
    std::string cert, key, ca;
    bool on() const { return !cert.empty(); }
    bool mutual() const { return !ca.empty(); }
};

// What a worker knows of its own trust: built once at start (tls_trust), read by the links and Describe.
struct Trust {
    bool tls = false, mutual = false;
    std::string member;                              // the common name of this worker's own certificate
    std::shared_ptr<grpc::ServerCredentials> server;
    std::shared_ptr<grpc::ChannelCredentials> channel;
};

// The flags checked as dgr.runtime.wire.tls.TlsConfig.from_args checks them (std::runtime_error naming the fix),
// the PEM files read, the credentials made. Plaintext when none is given.
Trust tls_trust(const TlsFiles & f);

// The common name(s) of a PEM certificate's subject, sorted and joined by ",";
// "" when it has none or cannot be read.
std::string cert_common_name(const std::string & pem);

// The first host a PEM certificate is issued for: its first DNS name or IP address among the subject
// alternative names (`dgr certs issue --host`), else its common name; "" when it cannot be read.
std::string cert_first_host(const std::string & pem);

// Who is on the other end of an RPC: the common name of its verified client certificate
// (dgr.runtime.wire.tls.peer_identity), nullopt without one (plaintext, or TLS without client certificates).
std::optional<std::string> peer_identity(const grpc::ServerContextBase * ctx);

}  // namespace dgr
