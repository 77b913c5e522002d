"""The committed generated code is exactly what the committed .proto files produce."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc_tools import protoc

PROTOS = Path(__file__).resolve().parents[2] / "protos"
PACKAGE = Path("card") / "v1"


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    sources = sorted((PROTOS / PACKAGE).glob("*.proto"))
    assert sources, f"no .proto files under {PROTOS / PACKAGE}"
    args = ["grpc_tools.protoc", f"-I{PROTOS}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}", *(str(p) for p in sources)]
    assert protoc.main(args) == 0, "protoc failed on the committed .proto files"
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / PACKAGE).iterdir())
    committed = sorted(p.relative_to(PROTOS) for pattern in ("*_pb2.py", "*_pb2_grpc.py", "*_pb2.pyi")
                       for p in (PROTOS / PACKAGE).glob(pattern))
    assert fresh == committed, "generated and committed file sets differ"
    stale = [str(rel) for rel in fresh if (tmp_path / rel).read_bytes() != (PROTOS / rel).read_bytes()]
    if stale:
        pytest.fail(
            f"generated code is stale: {', '.join(stale)}. Regenerate with `python -m grpc_tools.protoc "
            f"-I protos --python_out=protos --grpc_python_out=protos --pyi_out=protos protos/card/v1/*.proto`"
        )
