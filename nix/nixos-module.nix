# NixOS module: dgr shard workers as systemd services (docs/deploy.md, "NixOS").
#
#   services.dgr.workers.stage1 = {
#     bundle = "/srv/dgr/smollm2-135m-3stage-32052c63c9ad";   # a provisioned bundle (never under /home)
#     stage = 1;
#     listen = "10.0.0.2:7110";
#     lane = "cpu";                                            # the worker package: the flake's .#<lane>
#     tls = { cert = "/etc/dgr/stage1.pem"; key = "/etc/dgr/stage1.key"; ca = "/etc/dgr/ca.pem"; };
#   };
#
# Each worker becomes `dgr-worker-<name>.service`, run as `<package>/bin/dgr-worker serve ...` (the C++
# stage worker of nix/package.nix, no Python; it finds its engine at ../lib/libdgr_engine.so) with the
# flags `dgr up` and `dgr deploy render --systemd` give: restarted on failure, a dynamic user with no
# home directories, a read-only system, the TLS files handed over as credentials, memory and task limits.
# flake.nix exports it as nixosModules.default with `self` (for the default package of each lane).
{ self ? null }:
{ config, lib, pkgs, ... }:
let
  inherit (lib) mkOption types;
  cfg = config.services.dgr;
  lanes = [ "cpu" "cuda" "rocm" "vulkan" "metal" ];
  system = pkgs.stdenv.hostPlatform.system or pkgs.system;

  tlsOptions = {
    options = {
      cert = mkOption { type = types.str; description = "this worker's certificate (PEM; `dgr certs issue`)"; };
      key = mkOption { type = types.str; description = "its private key (readable by root; handed over as a credential)"; };
      ca = mkOption {
        type = types.nullOr types.str;
        default = null;
        description = "the operator's CA (PEM): peers must present a certificate it signed (mutual TLS)";
      };
    };
  };

  workerOptions = { name, ... }: {
    options = {
      bundle = mkOption { type = types.str; description = "the bundle folder in a store (<store>/<name>-<id12>)"; };
      stage = mkOption { type = types.int; description = "the stage of the bundle this worker serves"; };
      listen = mkOption { type = types.str; description = "HOST:PORT to serve on"; };
      lane = mkOption { type = types.enum lanes; default = "cpu"; description = "backend lane"; };
      package = mkOption {
        type = types.nullOr types.package;
        default = null;
        description = "the worker package (bin/dgr-worker); null: the dgr flake's package of the lane";
      };
      threads = mkOption { type = types.int; default = 0; description = "engine compute threads (0: default)"; };
      sessionTtl = mkOption { type = types.int; default = 300; description = "close sessions idle this long (s)"; };
      maxSessions = mkOption { type = types.int; default = 8; };
      nCtx = mkOption { type = types.int; default = 4096; };
      drainTimeout = mkOption { type = types.int; default = 5; description = "SIGTERM: exit within this (s)"; };
      tls = mkOption { type = types.nullOr (types.submodule tlsOptions); default = null; };
      insecure = mkOption { type = types.bool; default = false; description = "plaintext off loopback"; };
      memoryMax = mkOption { type = types.nullOr types.str; default = null; example = "4G"; };
      extraArgs = mkOption { type = types.listOf types.str; default = [ ]; };
    };
  };

  packageOf = w:
    if w.package != null then w.package
    else if self != null then self.packages.${system}.${w.lane}
    else throw "services.dgr.workers: give package (no dgr flake to take the ${w.lane} worker from)";

  tlsArgs = w:
    lib.optionals (w.tls != null) ([ "--tls-cert" "%d/tls.pem" "--tls-key" "%d/tls.key" ]
      ++ lib.optionals (w.tls.ca != null) [ "--tls-ca" "%d/ca.pem" ]);

  args = w: [
    "serve" "--bundle" w.bundle "--stage" (toString w.stage) "--listen" w.listen "--lane" w.lane
    "--threads" (toString w.threads) "--session-ttl" (toString w.sessionTtl)
    "--max-sessions" (toString w.maxSessions) "--n-ctx" (toString w.nCtx)
    "--drain-timeout" (toString w.drainTimeout)
  ] ++ tlsArgs w ++ lib.optionals w.insecure [ "--insecure" ] ++ w.extraArgs;

  service = name: w: lib.nameValuePair "dgr-worker-${name}" {
    description = "dgr worker ${name}: stage ${toString w.stage} of ${w.bundle}";
    wantedBy = [ "multi-user.target" ];
    after = [ "network-online.target" ];
    wants = [ "network-online.target" ];
    # dgr-worker is C++: no PYTHONUNBUFFERED to set. DGR_WORKSPACE is the state folder, as in the units
    # `dgr deploy render --systemd` writes.
    environment = { DGR_WORKSPACE = "/var/lib/dgr-worker-${name}"; };
    serviceConfig = {
      # %d/... are systemd's credentials folder: keep them unquoted
      ExecStart = "${packageOf w}/bin/dgr-worker ${lib.concatStringsSep " "
        (map (a: if lib.hasPrefix "%d/" a then a else lib.escapeShellArg a) (args w))}";
      Restart = "on-failure";
      RestartSec = 2;
      KillSignal = "SIGTERM";
      TimeoutStopSec = w.drainTimeout + 5;
      DynamicUser = true;
      StateDirectory = "dgr-worker-${name}";
      ProtectHome = true;
      ProtectSystem = "strict";
      ReadOnlyPaths = [ w.bundle ];
      PrivateTmp = true;
      PrivateDevices = w.lane == "cpu";
      NoNewPrivileges = true;
      LimitNOFILE = 65536;
      LimitCORE = 0;
      TasksMax = 512;
      LoadCredential = lib.optionals (w.tls != null) ([ "tls.pem:${w.tls.cert}" "tls.key:${w.tls.key}" ]
        ++ lib.optionals (w.tls.ca != null) [ "ca.pem:${w.tls.ca}" ]);
    } // lib.optionalAttrs (w.memoryMax != null) { MemoryMax = w.memoryMax; };
  };

  checks = name: w: [
    { assertion = !(lib.hasPrefix "/home/" w.bundle);
      message = "services.dgr.workers.${name}.bundle ${w.bundle} is under /home: stores belong on a data drive"; }
    { assertion = builtins.match ".*:[0-9]+" w.listen != null;
      message = "services.dgr.workers.${name}.listen ${w.listen}: give HOST:PORT"; }
  ];
in
{
  options.services.dgr.workers = mkOption {
    type = types.attrsOf (types.submodule workerOptions);
    default = { };
    description = "dgr shard workers, one systemd service each (dgr-worker-<name>)";
  };

  config = lib.mkIf (cfg.workers != { }) {
    assertions = lib.concatLists (lib.mapAttrsToList checks cfg.workers);
    systemd.services = lib.mapAttrs' service cfg.workers;
  };
}
