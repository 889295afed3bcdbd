"""Test support for dgr (as numpy.testing is for numpy): doubles that tests and the docs' examples
import, and that the runtime (dgr.runtime.engine, dgr.runtime.wire) never does."""
