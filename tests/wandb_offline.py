"""Read what an offline W&B run recorded (DIR/wandb/offline-run-*/run-*.wandb), without a W&B server.

The file is W&B's record log: a 7-byte header, then 32 KiB blocks of chunks (crc32, length, kind: full / first /
middle / last), each record a protobuf ``wandb.proto.wandb_internal_pb2.Record``.
"""
from __future__ import annotations

import struct
from pathlib import Path

BLOCK = 32768


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B record log"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the rest of a block too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""


def summary(run_dir: Path) -> dict:
    """{'config': {key: json}, 'metrics': set of logged keys, 'artifacts': [(type, name, files, aliases)],
    'group': str, 'id': str, 'exit_code': int | None} of one offline run folder."""
    import json

    (log,) = Path(run_dir).glob("run-*.wandb")
    out = {"config": {}, "metrics": set(), "artifacts": [], "group": None, "id": None, "exit_code": None}
    for r in records(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["group"], out["id"] = r.run.run_group, r.run.run_id
        elif kind == "config":
            for item in r.config.update:
                out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "history":
            out["metrics"] |= {i.key or "/".join(i.nested_key) for i in r.history.item}
        elif kind == "artifact":
            a = r.artifact
            out["artifacts"].append((a.type, a.name, sorted(c.path for c in a.manifest.contents), list(a.aliases)))
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out
