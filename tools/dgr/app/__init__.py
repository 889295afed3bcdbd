"""The application layer above dgr.wire: stages composed from bundles or fake specs, local routes of
worker processes, and the demo. It may use the build toolchain; the runtime below it never does."""
