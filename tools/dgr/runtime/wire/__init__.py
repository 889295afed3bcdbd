"""The wire: dgr.v1 protocol stubs, the stage worker, direct relay and the client (docs/wire.md)."""
