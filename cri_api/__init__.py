"""The CRI v1 schema (package runtime.v1) and its generated Python bindings.

`api.proto` is written in this project and is wire-identical to cri-api v0.36;
`api_pb2*.py` are generated from it by `scripts/gen-proto` and never edited.
"""
