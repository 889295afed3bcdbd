"""Generated protocol stubs (see dgr.toolchain.protogen)."""
