#include "tls.h"

#include <openssl/pem.h>
#include <openssl/x509v3.h>
#include <arpa/inet.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace dgr {

namespace {

std::string read_pem(const std::string & what, const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot read TLS material: " + what + " " + path + ": cannot open it");
    std::ostringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

bool is_file(const std::string & p) {
    struct stat st{};
    return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

namespace {

using X509Ptr = std::unique_ptr<X509, decltype(&X509_free)>;

// The first certificate of a PEM text, read by OpenSSL (null when there is none)
X509Ptr read_cert(const std::string & pem) {
    std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new_mem_buf(pem.data(), int(pem.size())), BIO_free);
    return X509Ptr(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr, X509_free);
}

}  // namespace

std::string cert_common_name(const std::string & pem) {
    // every commonName of its subject, sorted and joined by ","
    X509Ptr cert = read_cert(pem);
    if (!cert) return "";
    X509_NAME * subject = X509_get_subject_name(cert.get());
    std::vector<std::string> names;
    for (int i = X509_NAME_get_index_by_NID(subject, NID_commonName, -1); i >= 0;
         i = X509_NAME_get_index_by_NID(subject, NID_commonName, i)) {
        ASN1_STRING * value = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, i));
        unsigned char * utf8 = nullptr;
        int n = ASN1_STRING_to_UTF8(&utf8, value);
        if (n < 0) continue;
        names.emplace_back(reinterpret_cast<const char *>(utf8), size_t(n));
        OPENSSL_free(utf8);
    }
    std::sort(names.begin(), names.end());
    std::string out;
    for (auto & n : names) out += (out.empty() ? "" : ",") + n;
    return out;
}

std::string cert_first_host(const std::string & pem) {
    X509Ptr cert = read_cert(pem);
    if (!cert) return "";
    std::string out;
    auto * names = static_cast<GENERAL_NAMES *>(X509_get_ext_d2i(cert.get(), NID_subject_alt_name, nullptr, nullptr));
    for (int i = 0; names && out.empty() && i < sk_GENERAL_NAME_num(names); ++i) {
        const GENERAL_NAME * g = sk_GENERAL_NAME_value(names, i);
        if (g->type == GEN_DNS) {
            out.assign(reinterpret_cast<const char *>(ASN1_STRING_get0_data(g->d.dNSName)),
                       size_t(ASN1_STRING_length(g->d.dNSName)));
        } else if (g->type == GEN_IPADD) {
            const int n = ASN1_STRING_length(g->d.iPAddress);
            char text[INET6_ADDRSTRLEN] = {0};
            if ((n == 4 || n == 16) && inet_ntop(n == 4 ? AF_INET : AF_INET6, ASN1_STRING_get0_data(g->d.iPAddress),
                                                 text, sizeof text)) {
                out = text;
            }
        }
    }
    if (names) GENERAL_NAMES_free(names);
    if (out.empty()) {
        out = cert_common_name(pem);
        if (size_t comma = out.find(','); comma != std::string::npos) out.resize(comma);
    }
    return out;
}

Trust tls_trust(const TlsFiles & f) {
    Trust t;
    if (f.cert.empty() && f.key.empty()) {
        if (!f.ca.empty()) throw std::runtime_error("--tls-ca needs --tls-cert and --tls-key (this side's own certificate)");
        return t;
    }
    if (f.cert.empty() || f.key.empty()) throw std::runtime_error("give both --tls-cert and --tls-key (make them with `dgr certs issue`)");
    for (auto & [what, p] : {std::pair<const char *, std::string>{"--tls-cert", f.cert}, {"--tls-key", f.key}, {"--tls-ca", f.ca}}) {
        if (!p.empty() && !is_file(p)) {
            throw std::runtime_error(std::string(what) + " " + p + ": no such file (make one with `dgr certs init` / `dgr certs issue`)");
        }
    }
    const std::string cert = read_pem("--tls-cert", f.cert), key = read_pem("--tls-key", f.key);
    const std::string ca = f.ca.empty() ? "" : read_pem("--tls-ca", f.ca);
    if (cert.find("-----BEGIN CERTIFICATE-----") == std::string::npos) {
        throw std::runtime_error("--tls-cert " + f.cert + ": not a PEM certificate (make one with `dgr certs issue`)");
    }
    if (key.find("PRIVATE KEY-----") == std::string::npos) {
        throw std::runtime_error("--tls-key " + f.key + ": not a PEM private key (make one with `dgr certs issue`)");
    }
    if (!ca.empty() && ca.find("-----BEGIN CERTIFICATE-----") == std::string::npos) {
        throw std::runtime_error("--tls-ca " + f.ca + ": not a PEM certificate (the CA's ca.pem from `dgr certs init`)");
    }
    t.tls = true;
    t.mutual = !ca.empty();
    t.member = cert_common_name(cert);
    grpc::SslServerCredentialsOptions so(t.mutual ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                                  : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    so.pem_root_certs = ca;
    so.pem_key_cert_pairs.push_back({key, cert});
    t.server = grpc::SslServerCredentials(so);
    grpc::SslCredentialsOptions co;
    co.pem_root_certs = ca;                          // empty: the system's roots
    co.pem_private_key = key;
    co.pem_cert_chain = cert;
    t.channel = grpc::SslCredentials(co);
    return t;
}

std::optional<std::string> peer_identity(const grpc::ServerContextBase * ctx) {
    if (!ctx) return std::nullopt;
    std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
    if (!auth) return std::nullopt;
    std::vector<std::string> names;
    for (auto & v : auth->FindPropertyValues("x509_common_name")) names.emplace_back(v.data(), v.size());
    if (names.empty()) return std::nullopt;
    std::sort(names.begin(), names.end());
    std::string out;
    for (auto & n : names) out += (out.empty() ? "" : ",") + n;
    return out;
}

}  // namespace dgr
