"""The base layer: constants and dgr's GGUF keys, the stage contract, errors, paths, hashing, logging,
locks, downloads, and what workers advertise (descriptor, certificate: pure data). Imports nothing else
of dgr; every other layer may import it."""
