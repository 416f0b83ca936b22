"""TensorBoard's own code reads a log directory written by torchpoint's tfevents callback.

Usage: tfevents_check.py LOGDIR

First every event file is read record by record with TensorBoard's record reader (which checks
both CRC-32Cs of every record and raises on a torn or corrupt one) and parsed with its Event
protocol buffer; each file must begin with file_version "brain.Event:2". Then TensorBoard's
EventAccumulator loads the directory as `tensorboard --logdir` does (dropping what a restarted
run repeats) and the scalars are printed as JSON: {"files": N, "scalars": {tag: [[step, value],
...]}}.
"""
import json
import os
import sys

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New


def read_records(path):
    reader = PyRecordReader_New(path)
    events = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return events
        events.append(event_pb2.Event.FromString(reader.record()))


def main():
    logdir = sys.argv[1]
    files = sorted(f for f in os.listdir(logdir) if "tfevents" in f)
    assert files, f"no event file in {logdir}"
    for name in files:
        events = read_records(os.path.join(logdir, name))
        assert events and events[0].file_version == "brain.Event:2", f"{name}: {events[:1]}"
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    scalars = {
        tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
    }
    print(json.dumps({"files": len(files), "scalars": scalars}))


main()
