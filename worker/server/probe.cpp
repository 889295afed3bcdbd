// dgr-worker --probe (probe.h).
#include "probe.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/impl/rpc_method.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

namespace dgr {

namespace {

const char * const STATUS[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};

// grpc.health.v1.HealthCheckResponse: field 1 (status), a varint; absent is UNKNOWN (0)
int health_status(const grpc::ByteBuffer & reply) {
    std::vector<grpc::Slice> slices;
    if (!reply.Dump(&slices).ok()) return -1;
    std::string b;
    for (auto & s : slices) b.append(reinterpret_cast<const char *>(s.begin()), s.size());
    int status = 0;
    for (size_t i = 0; i < b.size();) {
        const unsigned tag = (unsigned char) b[i++];
        if ((tag & 7) != 0) return -1;              // the message has only varints
        uint64_t v = 0;
        for (int shift = 0; i < b.size(); shift += 7) {
            const unsigned char c = (unsigned char) b[i++];
            v |= uint64_t(c & 0x7f) << shift;
            if (!(c & 0x80)) break;
        }
        if ((tag >> 3) == 1) status = int(v);
    }
    return status;
}

}  // namespace

int probe_health(const std::string & address, const TlsFiles & files, double timeout_s) {
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    grpc::ChannelArguments args;
    if (files.on() || !files.key.empty() || files.mutual()) {
        const Trust t = tls_trust(files);            // the worker's own checks of the flags and files
        creds = t.channel;
        std::ifstream f(files.cert, std::ios::binary);
        std::ostringstream pem;
        pem << f.rdbuf();
        if (const std::string host = cert_first_host(pem.str()); !host.empty()) args.SetSslTargetNameOverride(host);
    }
    auto channel = grpc::CreateCustomChannel(address, creds, args);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(int64_t(timeout_s * 1000)));
    grpc::Slice empty("");                           // HealthCheckRequest{service: ""}: the whole server
    grpc::ByteBuffer request(&empty, 1), reply;
    const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check", grpc::internal::RpcMethod::NORMAL_RPC);
    const grpc::Status st = grpc::internal::BlockingUnaryCall(channel.get(), method, &ctx, request, &reply);
    if (!st.ok()) {
        std::printf("dgr-worker: probe %s: no answer: %s\n", address.c_str(), st.error_message().c_str());
        return 1;
    }
    const int status = health_status(reply);
    if (status == 1) {
        std::printf("SERVING\n");
        return 0;
    }
    std::printf("dgr-worker: probe %s: %s\n", address.c_str(), status >= 0 && status <= 3 ? STATUS[status] : "an unreadable reply");
    return 1;
}

}  // namespace dgr
