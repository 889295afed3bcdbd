"""Offline stand-in for @rules_python//python:defs.bzl: the native Python rules of Bazel 4."""

def py_binary(**kwargs):
    native.py_binary(**kwargs)

def py_library(**kwargs):
    native.py_library(**kwargs)

def py_test(**kwargs):
    native.py_test(**kwargs)

def py_runtime(**kwargs):
    native.py_runtime(**kwargs)

def py_runtime_pair(**kwargs):
    native.py_runtime_pair(**kwargs)
