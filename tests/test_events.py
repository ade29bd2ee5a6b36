"""TensorBoard event files: framing, CRC-32C and the Event protos, read back independently."""

import glob
import os
import struct

import numpy as np
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from sparsejax.train.events import EventWriter, crc32c
from sparsejax.train.metrics import MetricsWriter


def test_crc32c_matches_published_check_values():
  # RFC 3720 (iSCSI) B.4 test vectors and the CRC catalogue's check value for CRC-32C
  assert crc32c(b"123456789") == 0xE3069283
  assert crc32c(bytes(32)) == 0x8A9136AA
  assert crc32c(b"\xff" * 32) == 0x62A8AB43
  assert crc32c(bytes(range(32))) == 0x46DD794E


def _event_class():
  """tensorflow.Event with the fields scalars use, built from TensorFlow's field numbers
  (tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto)."""
  f = descriptor_pb2.FileDescriptorProto(name="sjx_test_event.proto", package="sjxtest")
  summary = f.message_type.add(name="Summary")
  value = summary.nested_type.add(name="Value")
  T = descriptor_pb2.FieldDescriptorProto
  value.field.add(name="tag", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
  value.field.add(name="simple_value", number=2, type=T.TYPE_FLOAT, label=T.LABEL_OPTIONAL)
  summary.field.add(name="value", number=1, type=T.TYPE_MESSAGE, label=T.LABEL_REPEATED,
                    type_name=".sjxtest.Summary.Value")
  event = f.message_type.add(name="Event")
  event.field.add(name="wall_time", number=1, type=T.TYPE_DOUBLE, label=T.LABEL_OPTIONAL)
  event.field.add(name="step", number=2, type=T.TYPE_INT64, label=T.LABEL_OPTIONAL)
  event.field.add(name="file_version", number=3, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
  event.field.add(name="summary", number=5, type=T.TYPE_MESSAGE, label=T.LABEL_OPTIONAL,
                  type_name=".sjxtest.Summary")
  pool = descriptor_pool.DescriptorPool()
  pool.Add(f)
  return message_factory.GetMessageClass(pool.FindMessageTypeByName("sjxtest.Event"))


def _records(path):
  """The records of a TFRecord file, checking both masked CRCs of each."""
  def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

  data, out, at = open(path, "rb").read(), [], 0
  while at < len(data):
    header = data[at:at + 8]
    (length,), (crc,) = struct.unpack("<Q", header), struct.unpack("<I", data[at + 8:at + 12])
    assert crc == masked(header)
    body = data[at + 12:at + 12 + length]
    assert struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == masked(body)
    out.append(body)
    at += 16 + length
  assert at == len(data)
  return out


def test_event_file_parses_as_tensorflow_events(tmp_path):
  rng = np.random.default_rng()
  steps = sorted(int(s) for s in rng.choice(10**9, 5, replace=False))
  values = [{"train/loss": float(rng.standard_normal()), "train/lr": float(rng.random()),
             "eval/top-5 accuracy": float(rng.random())} for _ in steps]
  w = EventWriter(str(tmp_path / "tb"))
  for step, scalars in zip(steps, values):
    w.write(np.int64(step) if step % 2 else step, scalars)
  w.close()
  [path] = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
  Event = _event_class()
  events = [Event.FromString(r) for r in _records(path)]
  assert events[0].file_version == "brain.Event:2"
  assert [e.step for e in events[1:]] == steps
  for e, scalars in zip(events[1:], values):
    assert e.wall_time > 1.6e9
    got = {v.tag: v.simple_value for v in e.summary.value}
    assert got.keys() == scalars.keys()
    np.testing.assert_allclose(list(got.values()), list(scalars.values()), rtol=1e-7)


@pytest.mark.parametrize("step", [-1, 2.0, True, "3"])
def test_bad_step_is_named(tmp_path, step):
  w = EventWriter(str(tmp_path))
  with pytest.raises(ValueError, match=f"step must be an integer >= 0, got {step!r}"):
    w.write(step, {"a": 1.0})
  w.close()


def test_metrics_writer_logs_every_split_to_one_event_file(tmp_path):
  m = MetricsWriter(str(tmp_path))
  m.write("train", 5, {"loss": 2.5, "lr": 0.1})
  m.write("eval", 5, {"accuracy": 0.75})
  m.close()
  [path] = glob.glob(os.path.join(tmp_path, "tensorboard", "events.out.tfevents.*"))
  Event = _event_class()
  events = [Event.FromString(r) for r in _records(path)][1:]
  assert [{v.tag: v.simple_value for v in e.summary.value} for e in events] == [
      {"train/loss": 2.5, "train/lr": pytest.approx(0.1)}, {"eval/accuracy": 0.75}]


@pytest.mark.slow
def test_tensorflow_reads_the_event_file(tmp_path):
  """The real reader (slow: TensorFlow takes ~13 s to import here)."""
  tf = pytest.importorskip("tensorflow", reason="needs TensorFlow: pip install -e '.[prepare]'")
  w = EventWriter(str(tmp_path))
  w.write(7, {"train/loss": 1.25})
  w.close()
  [path] = glob.glob(str(tmp_path / "events.out.tfevents.*"))
  events = list(tf.compat.v1.train.summary_iterator(path))
  assert events[0].file_version == "brain.Event:2"
  assert events[1].step == 7 and events[1].summary.value[0].tag == "train/loss"
  assert events[1].summary.value[0].simple_value == 1.25


def test_a_metric_first_written_later_gets_its_column(tmp_path):
  """auto's rests and selection appear after its first choice: the CSV gains their columns
  (earlier rows empty there) instead of dropping them, and a resume keeps every column."""
  import csv
  writer = MetricsWriter(str(tmp_path))
  writer.write("auto", 0, {"dense": 1.0, "probe_ms": 5.0})
  writer.write("auto", 4, {"dense": 1.0, "probe_ms": 5.0, "dense_rest_ms": 30.0})
  writer.write("auto", 9, {"dense": 0.0, "select_ms": 2.5, "dense_rest_ms": 31.0})
  writer.close()
  with open(tmp_path / "auto.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  assert list(rows[0]) == ["step", "dense", "probe_ms", "dense_rest_ms", "select_ms"]
  assert [(r["step"], r["dense_rest_ms"], r["select_ms"]) for r in rows] == [
      ("0", "", ""), ("4", "30.0", ""), ("9", "31.0", "2.5")]
  resumed = MetricsWriter(str(tmp_path), resume_step=4)  # (rows after step 4 dropped)
  resumed.close()
  with open(tmp_path / "auto.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  assert [r["step"] for r in rows] == ["0", "4"] and "select_ms" in rows[0]
