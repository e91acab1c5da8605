"""hf_aoq.serialization.shards, the one checkpoint reader, and the atomic writers: a checkpoint's
files are one save or a FormatError naming them; the index names only files in its folder; a
folder holds one checkpoint; a full disk names the file and leaves nothing half-written."""
import errno
import json
import os
import shutil

import pytest
import safetensors
import safetensors.torch
import torch

from hf_aoq import AOQTensor, FormatError, Int4Tensor, Int8Tensor
from hf_aoq import checkpoint as inspect_reader
from hf_aoq import serialization as S


def weight(seed, n=32, k=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).to(torch.bfloat16)


def state_dict(seed=0):
    return {
        "a.weight": Int4Tensor.from_float(weight(seed), group_size=32),
        "a.bias": torch.arange(32, dtype=torch.float32) + seed,
        "b.weight": Int8Tensor.from_float(weight(seed + 1)),
        "c.weight": weight(seed + 2),
    }


def assert_same(got, sd):
    assert got.keys() == sd.keys()
    for n, t in sd.items():
        if isinstance(t, AOQTensor):
            assert type(got[n]) is type(t) and torch.equal(got[n].dequantize(), t.dequantize()), n
        else:
            assert torch.equal(got[n], t), n


def metadata_of(path):
    with safetensors.safe_open(str(path), "pt") as f:
        return f.metadata()


def resave(path, edit):
    """Re-save one shard with (tensors, metadata) passed through `edit`."""
    with safetensors.safe_open(str(path), "pt") as f:
        tensors, metadata = edit(f.get_tensors(), f.metadata())
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


@pytest.fixture
def sharded(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    S.save_shards(state_dict(), folder, max_shard_size=3000)
    return folder


def shards_of(folder):
    return sorted(p.name for p in folder.glob("model-*.safetensors"))


# ---------------------------------------------------------------------- one save, one id
def test_save_shards_marks_every_file_with_one_save_id(sharded, tmp_path):
    shards = shards_of(sharded)
    assert len(shards) == 3 and not (sharded / S.WEIGHTS_NAME).exists()
    index = json.loads((sharded / S.INDEX_NAME).read_text())
    ids = {metadata_of(sharded / s)[S.SAVE_ID_KEY] for s in shards}
    assert ids == {index["metadata"][S.SAVE_ID_KEY]} and len(ids.pop()) == 32
    assert_same(S.load_checkpoint(sharded), state_dict())
    # A second save gets a new id; one file is written (and marked) below the size limit.
    single = tmp_path / "single"
    single.mkdir()
    S.save_shards(state_dict(), single, max_shard_size=1 << 30)
    assert sorted(os.listdir(single)) == [S.WEIGHTS_NAME]
    assert metadata_of(single / S.WEIGHTS_NAME)[S.SAVE_ID_KEY] != index["metadata"][S.SAVE_ID_KEY]
    assert_same(S.load_checkpoint(single), state_dict())
    with pytest.raises(FormatError, match="already holds model.safetensors"):
        S.save_shards(state_dict(), single, max_shard_size=3000)


def test_shards_of_two_saves_are_refused_naming_them(sharded, tmp_path):
    """An interrupted save over an older checkpoint: its first shard is new, the others old."""
    other = tmp_path / "other"
    other.mkdir()
    S.save_shards(state_dict(seed=5), other, max_shard_size=3000)
    first, *rest = shards_of(sharded)
    shutil.copy(other / first, sharded / first)
    match = (rf"^{sharded}: the checkpoint's files come from different saves \(save \w{{12}} in {first}; "
             rf"save \w{{12}} in {rest[0]}, {rest[1]}; save \w{{12}} in {S.INDEX_NAME}\)")
    for read in (S.load_checkpoint, inspect_reader.read_checkpoint, S.open_checkpoint):
        with pytest.raises(FormatError, match=match):
            read(sharded)


def test_a_shard_without_an_id_among_shards_with_one_is_refused(sharded):
    shard = sharded / shards_of(sharded)[1]
    resave(shard, lambda t, m: (t, {k: v for k, v in m.items() if k != S.SAVE_ID_KEY}))
    with pytest.raises(FormatError, match=rf"different saves \(.*no save id in {shard.name}"):
        S.load_checkpoint(sharded)


def test_a_checkpoint_without_save_ids_loads(sharded):
    """Checkpoints written before save ids existed (the fixtures are single files of that age)."""
    for name in shards_of(sharded):
        resave(sharded / name, lambda t, m: (t, {k: v for k, v in m.items() if k != S.SAVE_ID_KEY}))
    index = json.loads((sharded / S.INDEX_NAME).read_text())
    del index["metadata"][S.SAVE_ID_KEY]
    (sharded / S.INDEX_NAME).write_text(json.dumps(index))
    assert_same(S.load_checkpoint(sharded), state_dict())


@pytest.mark.parametrize("value", ["", "ABCDEF" * 6, "0" * 31, "x" * 100_000])
def test_a_malformed_save_id_is_refused(sharded, value):
    shard = sharded / shards_of(sharded)[0]
    resave(shard, lambda t, m: (t, {**m, S.SAVE_ID_KEY: value}))
    with pytest.raises(FormatError, match=rf"{shard}: __metadata__: hf_aoq_save_id must be 32 lowercase hex") as e:
        S.load_checkpoint(sharded)
    assert len(str(e.value)) < 500


# ---------------------------------------------------------------------- which files
def test_a_folder_with_both_layouts_is_refused(sharded, tmp_path):
    S.save_file(state_dict(seed=3), sharded / S.WEIGHTS_NAME)
    for read in (S.load_checkpoint, inspect_reader.read_checkpoint):
        with pytest.raises(FormatError, match=f"^{sharded}: holds both model.safetensors and "
                                              f"model.safetensors.index.json"):
            read(sharded)


@pytest.mark.parametrize("name", ["../x.safetensors", "/tmp/x.safetensors", "sub/x.safetensors", "x.bin",
                                  "C:x.safetensors", "..\\x.safetensors", 7])
def test_an_index_names_only_files_in_its_folder(sharded, name):
    index = json.loads((sharded / S.INDEX_NAME).read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = name
    (sharded / S.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(FormatError, match=rf"{sharded / S.INDEX_NAME}: checkpoint index: '{key}' is in shard "
                                          rf".*, which is not a \.safetensors file in the index's folder"):
        S.load_checkpoint(sharded)


@pytest.mark.parametrize("text, match", [
    ("[]", "must be a JSON object"),
    ('{"weight_map": {}}', "'weight_map' must be a non-empty object"),
    ('{"metadata": {}}', "no 'weight_map'"),
    ('{"weight_map": {"a": "x.safetensors"}, "extra": 1}', "unknown key 'extra'"),
    ('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "key 'a' appears twice"),
    ('{"weight_map": {"a": "x.safetensors"}, "metadata": []}', "'metadata' must be an object"),
    ('{"weight_map": {"a": "x.safetensors"}, "metadata": {"hf_aoq_save_id": 1}}', "must be 32 lowercase hex"),
    ("{not json", "not valid JSON"),
])
def test_a_malformed_index_is_refused(sharded, text, match):
    (sharded / S.INDEX_NAME).write_text(text)
    with pytest.raises(FormatError, match=f"^{sharded / S.INDEX_NAME}: .*{match}"):
        S.load_checkpoint(sharded)


def test_a_stale_or_incomplete_index_is_refused(sharded):
    index_path = sharded / S.INDEX_NAME
    good = json.loads(index_path.read_text())
    shards = shards_of(sharded)
    key = "a.weight:scale"
    wrong = next(s for s in shards if s != good["weight_map"][key])
    cases = [
        ({**good["weight_map"], key: wrong}, rf"{index_path}: lists '{key}' in {wrong}, but it is in "),
        ({**good["weight_map"], "ghost": shards[0]}, rf"{index_path}: lists 'ghost' in {shards[0]}, but no shard"),
        ({k: v for k, v in good["weight_map"].items() if k != key}, rf"holds '{key}', which {S.INDEX_NAME} does not"),
    ]
    for weight_map, match in cases:
        index_path.write_text(json.dumps({**good, "weight_map": weight_map}))
        with pytest.raises(FormatError, match=match):
            S.load_checkpoint(sharded)
    index_path.write_text(json.dumps(good))
    os.unlink(sharded / shards[-1])
    with pytest.raises(FormatError, match=rf"{sharded / shards[-1]}: listed in {index_path} but missing"):
        S.load_checkpoint(sharded)


def test_a_key_in_two_shards_is_refused_naming_both(sharded):
    first, second = shards_of(sharded)[:2]
    with safetensors.safe_open(str(sharded / first), "pt") as f:
        key = next(iter(f.keys()))
        value = f.get_tensor(key)
    resave(sharded / second, lambda t, m: ({**t, key: value}, m))
    with pytest.raises(FormatError, match=rf"'{key}' is stored in both {first} and {second}"):
        S.load_checkpoint(sharded)


def test_a_tensor_described_differently_in_two_shards_is_refused(tmp_path):
    """Shards that each carry the whole metadata (as save_pretrained writes) must agree."""
    sd = state_dict()
    tensors, metadata = S.flatten_state_dict(sd)
    doc = json.loads(metadata[S.METADATA_KEY])
    doc["tensors"]["b.weight"]["attributes"]["dtype"] = ["dtype", "float16"]
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for i, (name, part) in enumerate(halves.items()):
        meta = metadata if i == 0 else {**metadata, S.METADATA_KEY: json.dumps(doc)}
        safetensors.torch.save_file({k: tensors[k] for k in part}, str(tmp_path / name), metadata=meta)
    weight_map = {k: name for name, part in halves.items() for k in part}
    (tmp_path / S.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(FormatError, match=r"model-00002-of-00002.safetensors: tensor 'b.weight': described "
                                          r"differently in model-00001-of-00002.safetensors"):
        S.load_checkpoint(tmp_path)
    # The same text in every shard, fields split between them: the union loads.
    for name, part in halves.items():
        safetensors.torch.save_file({k: tensors[k] for k in part}, str(tmp_path / name), metadata=metadata)
    assert_same(S.load_checkpoint(tmp_path), sd)


def test_the_quantizer_gets_headers_without_data(sharded):
    ckpt = S.open_checkpoint(sharded)
    ckpt.check()
    stored = ckpt.stored("a.weight:qdata")
    assert (stored.dtype_name, stored.dtype, stored.shape) == ("U8", torch.uint8, [32, 32])
    assert ckpt.save_id is not None and ckpt.format_versions == [1] and set(ckpt.entries) == {"a.weight", "b.weight"}


# ---------------------------------------------------------------------- writing: full disk
def test_a_full_disk_names_the_file_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    S.save_file(state_dict(), path)
    before = path.read_bytes()

    def full_disk(tensors, p, metadata):
        with open(p, "wb") as f:
            f.write(b"half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(S.files, "_write_safetensors", full_disk)
    for target in (path, tmp_path / "new.safetensors"):
        with pytest.raises(OSError, match=f"cannot write {target}: No space left on device") as e:
            S.save_file(state_dict(seed=1), target)
        assert e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == ["model.safetensors"] and path.read_bytes() == before

    def safetensors_full_disk(tensors, p, metadata):  # how safetensors itself reports it
        raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                          'message: "No space left on device" })')

    monkeypatch.setattr(S.files, "_write_safetensors", safetensors_full_disk)
    with pytest.raises(OSError, match=f"cannot write {path}: .*No space left on device") as e:
        S.save_file(state_dict(seed=1), path)
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == ["model.safetensors"] and path.read_bytes() == before


def test_write_atomic(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    S.write_atomic(path, "{}\n")
    S.write_atomic(path, b"[1]\n")
    assert path.read_text() == "[1]\n"

    def fail_replace(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", fail_replace)
    with pytest.raises(OSError, match=f"cannot write {path}: No space left on device"):
        S.write_atomic(path, "{}")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["config.json"] and path.read_text() == "[1]\n"


def test_the_files_a_loader_resolved_must_be_the_checkpoints(sharded, tmp_path):
    """transformers resolves the files itself (joining the folder and the index's names)."""
    files = [str(sharded / s) for s in shards_of(sharded)]
    assert S.read_loader_files(files).save_id is not None
    stray = tmp_path / "x.safetensors"
    shutil.copy(files[-1], stray)
    with pytest.raises(FormatError, match=rf"^{sharded}: the loader reads '{sharded}/../x.safetensors', which is "
                                          rf"not a file of this checkpoint"):
        S.read_loader_files(files[:-1] + [f"{sharded}/../x.safetensors"])
    # A file named otherwise next to a model.safetensors (a variant) is read as given.
    single = tmp_path / "single"
    single.mkdir()
    S.save_file(state_dict(), single / S.WEIGHTS_NAME)
    S.save_file(state_dict(seed=4), single / "model.fp16.safetensors")
    assert_same(S.read_loader_files([single / "model.fp16.safetensors"]).state_dict(), state_dict(seed=4))
