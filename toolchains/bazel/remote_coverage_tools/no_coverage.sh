#!/bin/sh
echo "bazel coverage is not available on the offline Bazel 4 path (see toolchains/bazel/README.md)" >&2
exit 1
