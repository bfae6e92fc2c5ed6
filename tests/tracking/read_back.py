"""Reads back what oxrl's tracking backends wrote for a run directory, with the backends' own
packages, and prints it as one JSON object (tests/integration/tracking.rs compares them):

  {"metrics": {"steps": [step, ...], "series": {key: [[step, value], ...]}},
   "tensorboard": {"files": N, "scalars": {tag: [[step, value], ...]}},
   "wandb": [{"name", "config", "exit_code", "history": [[step, {key: value}], ...]}, ...]}

Every value is a string, the shortest decimal that reads back as the same double (Python's
repr), so that the comparison sees every bit (a JSON number read by serde_json may lose the
last). "metrics" is metrics.jsonl's every numeric key but `step`, read by Python's exact parser.

TensorBoard through its EventAccumulator (what the TensorBoard UI loads: the files of a folder
in name order, the latest value of a step kept). W&B offline runs (RUN_DIR/wandb/offline-run-*,
in name order) through their transaction log, `run-<id>.wandb`: a LevelDB-style log (a 7-byte
header ":W&B", 0xBEE1, version 0; then 32 KiB blocks of chunks, each a 7-byte header
crc32 | length u16 | type u8, type 1 full, 2 first, 3 middle, 4 last, the CRC-32 of the type
byte then the data) of protobuf `Record`s, decoded with wandb's own classes.
"""

import glob
import json
import os
import struct
import sys
import zlib

from tensorboard.backend.event_processing import event_accumulator
from wandb.proto import wandb_internal_pb2

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path):
    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, parts = HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's tail too short for a header is padding
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if (crc, length, kind) == (0, 0, 0):  # zero padding to the block's end
            pos += room
            continue
        body = data[pos + HEADER:pos + HEADER + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at {pos}"
        assert kind in (FULL, FIRST, MIDDLE, LAST), f"{path}: chunk type {kind} at {pos}"
        pos += HEADER + length
        parts += body
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def exact(x):
    return repr(float(x))


def numeric(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def item_key(item):
    return item.key or ".".join(item.nested_key)


def wandb_run(path):
    run = {"name": None, "config": {}, "exit_code": None, "history": []}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run["name"] = r.run.display_name
            for u in r.run.config.update:
                run["config"][item_key(u)] = json.loads(u.value_json)
        elif kind == "config":
            for u in r.config.update:
                run["config"][item_key(u)] = json.loads(u.value_json)
        elif kind == "history":
            values = {item_key(i): json.loads(i.value_json) for i in r.history.item}
            values = {k: exact(v) for k, v in values.items() if not k.startswith("_")}
            run["history"].append([r.history.step.num, values])
        elif kind == "exit":
            run["exit_code"] = r.exit.exit_code
    return run


def main():
    run_dir = sys.argv[1]
    out = {}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        steps, series = [], {}
        for line in filter(str.strip, open(metrics)):
            record = json.loads(line)
            steps.append(record["step"])
            for k, v in record.items():
                if k != "step" and numeric(v):
                    series.setdefault(k, []).append([record["step"], exact(v)])
        out["metrics"] = {"steps": steps, "series": series}
    tb_dir = os.path.join(run_dir, "tensorboard")
    if os.path.isdir(tb_dir):
        acc = event_accumulator.EventAccumulator(tb_dir, size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        scalars = {tag: [[e.step, exact(e.value)] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
        out["tensorboard"] = {"files": len(os.listdir(tb_dir)), "scalars": scalars}
    paths = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")))
    out["wandb"] = [wandb_run(p) for p in paths]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
