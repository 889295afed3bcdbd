// The certificates of certification (`dgr certify`, DIR/*.json, schema dgr.certificate/v1) dgr-worker
// advertises (--certs, --contract): dgr.core.certificate.check, ported, over every file of DIR. A certificate
// is held only when its identity equals this worker's exactly, it covers this stage, its contract file still
// has the blake3 it records and every figure passed; every other one is logged with the reason and ignored.
// (The TLS certificates that `dgr certs` makes are tls.h's.)
#pragma once

#include <string>
#include <vector>

namespace dgr {

// What a worker compares a certificate's identity with (dgr.core.certificate.IDENTITY_FIELDS, then worker_blake3).
struct CertIdentity {
    std::string model, bundle_id, lane, upstream_commit, patch_series, engine_blake3;
    std::string worker_blake3;   // this dgr-worker executable's blake3: a certificate names the binary it measured
    std::string numerics;        // the engine's numerics (docs/numerics.md): a certificate names what it measured
    int stage_index = 0, layer_begin = 0, layer_end = 0;
};

// One advertised certificate (dgr.core.descriptor.HeldCertificate).
struct HeldCertificate {
    std::string id, contract, contract_blake3, lane, issued_at, summary;
};

// DIR/*.json in name order; `contract` "" means the path each certificate records (relative: from the
// current directory; give `contract` when it differs). Throws on a missing DIR or contract file;
// logs each ignored or advertised certificate to stderr in dgr.core.certificate.check's words.
std::vector<HeldCertificate> held_certificates(const std::string & dir, const CertIdentity & mine,
                                               const std::string & contract);

}  // namespace dgr
