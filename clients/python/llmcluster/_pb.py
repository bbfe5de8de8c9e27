"""Loads the protobuf modules that `python3 -m llmcluster.build` generated:
from $LLMCLUSTER_PROTO_DIR when set, else from llmcluster/_generated/."""

import importlib
import importlib.util
import os
import sys

_PKG = "llmcluster._generated"


def _load():
    d = os.environ.get("LLMCLUSTER_PROTO_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "_generated")
    if not os.path.isfile(os.path.join(d, "client_pb2.py")):
        raise ImportError(
            f"llmcluster: no generated protobuf modules in {d}: run `python3 -m llmcluster.build` "
            "(needs protoc, Debian package protobuf-compiler) or set LLMCLUSTER_PROTO_DIR to where they were generated")
    if _PKG not in sys.modules:
        spec = importlib.util.spec_from_file_location(_PKG, os.path.join(d, "__init__.py"),
                                                      submodule_search_locations=[d])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_PKG] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(_PKG + ".client_pb2"), importlib.import_module(_PKG + ".types_pb2")


client_pb2, types_pb2 = _load()
