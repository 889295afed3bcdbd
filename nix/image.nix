# The worker's OCI image of one lane (docs/deploy.md, "Container image"), as `dgr release image` and Bazel's
# //:image_cpu make it from the release archive, here built by nixpkgs' dockerTools from the lane's package:
# dgr-worker and its engine, a non-root user (65532, as dgr.toolchain.image.USER), the mount points, no
# shell and no Python. buildLayeredImage is reproducible: the same inputs give the same bytes.
#   nix build .#image-cpu && docker load < result
{
  dockerTools,
  runCommand,
  worker,
  version,
}:
let
  uid = "65532";
  lane = worker.passthru.lane or "cpu";
  # /etc/passwd and /etc/group naming the user; the store, state and TLS mount points; a writable /tmp
  base = runCommand "dgr-worker-image-base" { } ''
    mkdir -p $out/etc $out/var/lib/dgr/store $out/var/lib/dgr/state $out/etc/dgr/tls $out/tmp
    printf 'root:x:0:0:root:/root:/sbin/nologin\ndgr:x:${uid}:${uid}:dgr stage worker:/var/lib/dgr/state:/sbin/nologin\n' > $out/etc/passwd
    printf 'root:x:0:\ndgr:x:${uid}:\n' > $out/etc/group
  '';
in
dockerTools.buildLayeredImage {
  name = "dgr-worker";
  tag = "${version}-${lane}";
  contents = [
    worker
    base
  ];
  config = {
    User = "${uid}:${uid}";
    Entrypoint = [ "${worker}/bin/dgr-worker" ];
    Cmd = [ "--help" ];
    Env = [ "DGR_ENGINE_LIB=${worker}/lib/libdgr_engine.so" ];
    WorkingDir = "/var/lib/dgr/state";
    ExposedPorts = {
      "7000/tcp" = { };
    };
    StopSignal = "SIGTERM";
    Labels = {
      "org.opencontainers.image.title" = "dgr-worker";
      "org.opencontainers.image.version" = version;
      "dgr.lane" = lane;
      "dgr.mounts" = "the bundle's store read-only at /var/lib/dgr/store, TLS files at /etc/dgr/tls, state at /var/lib/dgr/state, /tmp writable";
      "dgr.health" = "grpc.health.v1 on the --listen port: a Kubernetes grpc probe in plaintext; under mutual TLS the exec probe `dgr-worker --probe 127.0.0.1:PORT` with the pod's certificate";
    };
  };
}
