"""`dgr certs init|issue`: a local CA and the member certificates for mutual TLS between stages."""

from __future__ import annotations


def register(sub) -> None:
    c = sub.add_parser("certs", help="a local certificate authority for TLS between stages (mTLS)")
    csub = c.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    i = csub.add_parser("init", help="make a CA in DIR (ca.pem for every peer, ca.key kept private)")
    i.add_argument("dir")
    i.add_argument("--name", default="dgr mesh CA", help="the CA's common name")
    i.add_argument("--force", action="store_true", help="replace an existing CA (its members stop being trusted)")
    i.set_defaults(func=_init)
    s = csub.add_parser("issue", help="a key and certificate for one member (worker or client), signed by DIR's CA")
    s.add_argument("dir")
    s.add_argument("name", help="the member's name: files NAME.pem and NAME.key")
    s.add_argument("--host", action="append", required=True,
                   help="a DNS name or IP address peers use to reach it (repeat for more)")
    s.set_defaults(func=_issue)


def _init(args) -> int:
    # lazy: dgr.app.certs needs cryptography, not in a release (pyproject.toml [tool.dgr.release])
    from dgr.app.certs import init

    ca = init(args.dir, name=args.name, force=args.force)
    print(f"CA: {ca} (give it to every peer as --tls-ca; keep {ca.with_name('ca.key')} private)")
    return 0


def _issue(args) -> int:
    # lazy: dgr.app.certs needs cryptography, not in a release (pyproject.toml [tool.dgr.release])
    from dgr.app.certs import issue

    cert, key = issue(args.dir, args.name, args.host)
    print(f"{args.name}: {cert} and {key} (--tls-cert {cert} --tls-key {key}), for {', '.join(args.host)}")
    return 0
