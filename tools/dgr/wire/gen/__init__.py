"""Generated protocol stubs (see dgr.wire.protogen)."""
