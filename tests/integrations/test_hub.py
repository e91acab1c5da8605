"""push_to_hub through huggingface_hub's real client, against the local Hub of tests/hub_server.py
(the `hub` fixture in conftest.py): shards go up through the LFS API, config and card inline;
from_pretrained(repo) downloads them back through the same server and gives the same logits."""
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import hf_aoq
from hf_aoq import cli
from hf_aoq.model_card import END, START

REPO = "user/tiny-llama-aoq"


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))


def quantized(path):
    config = hf_aoq.AOQConfig(hf_aoq.FqnToConfig({
        "_default": hf_aoq.Int4WeightOnlyConfig(group_size=32),
        "re:.*self_attn\\.[qk]_proj": hf_aoq.Int8WeightOnlyConfig(),
    }))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=config)


def logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits.float()


def test_push_to_hub_uploads_shards_config_and_card_and_loads_back(hub, tiny_llama_dir, ids, tmp_path):
    model = quantized(tiny_llama_dir)
    expected = logits(model, ids)
    model.push_to_hub(REPO, max_shard_size="300KB")  # several shards: the index goes up too

    repo = hub.repos[REPO]
    shards = [p for p in repo.files if p.endswith(".safetensors")]
    assert len(shards) > 1 and set(shards) <= repo.lfs  # shards went through LFS, as on the Hub
    assert {"config.json", "model.safetensors.index.json", "README.md"} <= set(repo.files) - repo.lfs
    assert any(path.endswith("/info/lfs/objects/batch") for _, path in hub.requests)
    card = repo.files["README.md"].decode()
    assert card.startswith("---\n") and START in card and END in card
    assert f'from_pretrained("{REPO}")' in card
    assert "int4 g32 asym" in card and "int8 per-row" in card

    again = AutoModelForCausalLM.from_pretrained(REPO, cache_dir=tmp_path / "cache")
    assert isinstance(again.model.layers[0].mlp.down_proj.weight, hf_aoq.Int4Tensor)
    assert isinstance(again.model.layers[0].self_attn.q_proj.weight, hf_aoq.Int8Tensor)
    torch.testing.assert_close(logits(again, ids), expected, rtol=0, atol=0)
    assert any(path.startswith(f"/{REPO}/resolve/") for _, path in hub.requests)


def test_push_keeps_the_card_already_on_the_hub(hub, tiny_llama_dir):
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(REPO)
    api.upload_file(path_or_fileobj=b"---\nlicense: mit\n---\n\n# My model\n\nMy words.\n", path_in_repo="README.md",
                    repo_id=REPO)
    model = quantized(tiny_llama_dir)
    model.push_to_hub(REPO)
    model.push_to_hub(REPO)  # twice: the section is replaced, not repeated
    card = hub.repos[REPO].files["README.md"].decode()
    # The user's front matter and words stay; the front matter gains the keys it lacked.
    meta = yaml.safe_load(card.split("---\n", 2)[1])
    assert meta["license"] == "mit" and "hf_aoq" in meta["tags"] and meta["library_name"] == "transformers"
    assert card.split("---\n", 2)[2].startswith("\n# My model\n\nMy words.\n")
    assert card.count(START) == 1 and card.count(END) == 1


def test_save_pretrained_with_push_to_hub_uploads_the_card_too(hub, tiny_llama_dir, tmp_path):
    model = quantized(tiny_llama_dir)
    model.save_pretrained(tmp_path / "out", push_to_hub=True, repo_id=REPO)
    files = hub.repos[REPO].files
    assert files["model.safetensors"] == (tmp_path / "out" / "model.safetensors").read_bytes()
    card = files["README.md"].decode()
    assert card.count(START) == 1 and f'from_pretrained("{REPO}")' in card


def test_cli_quantizes_a_hub_model_and_pushes_it(hub, tiny_llama_dir, ids, tmp_path, capsys):
    from huggingface_hub import HfApi

    HfApi().create_repo("user/tiny-float")
    HfApi().upload_folder(folder_path=str(tiny_llama_dir), repo_id="user/tiny-float")
    out = tmp_path / "int8"
    rc = cli.main(["quantize", "user/tiny-float", "--scheme", "int8", "--out", str(out), "--push-to-hub", REPO])
    assert rc == 0, capsys.readouterr().err
    repo = hub.repos[REPO]
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json"} <= set(repo.files)
    card = repo.files["README.md"].decode()
    meta = yaml.safe_load(card.split("---\n", 2)[1])
    assert meta["base_model"] == "user/tiny-float" and meta["base_model_relation"] == "quantized"
    assert "| base model | `user/tiny-float` |" in card
    assert "weight SQNR" in card and f'from_pretrained("{REPO}")' in card  # measured on the downloaded weights
    assert f"pushed to {hub.url}/{REPO}/commit/" in capsys.readouterr().out

    again = AutoModelForCausalLM.from_pretrained(REPO, cache_dir=tmp_path / "cache")
    local = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(again.model.layers[1].mlp.up_proj.weight, hf_aoq.Int8Tensor)
    torch.testing.assert_close(logits(again, ids), logits(local, ids), rtol=0, atol=0)


def test_loading_a_missing_repo_is_a_clear_error(hub, tmp_path):
    with pytest.raises(OSError, match="user/nothing-here"):
        AutoModelForCausalLM.from_pretrained("user/nothing-here", cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------------- hf-aoq push, and checks before quantizing
@pytest.fixture
def saved(tiny_llama_dir, tmp_path):
    out = tmp_path / "saved"
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "int8", "--out", str(out)]) == 0
    return out


def test_push_command_uploads_a_saved_folder_private_to_a_branch_or_as_a_pr(hub, saved, capsys):
    assert cli.main(["push", str(saved), "user/pushed", "--private"]) == 0
    repo = hub.repos["user/pushed"]
    assert repo.private and repo.commit_revisions[-1] == "main"
    assert repo.files["model.safetensors"] == (saved / "model.safetensors").read_bytes()
    card = repo.files["README.md"].decode()
    assert 'from_pretrained("user/pushed")' in card and "weight SQNR" in card  # quantize's figures are kept
    assert not [p for p in repo.files if p.startswith(".") and p != ".gitattributes"]
    assert f"pushed to {hub.url}/user/pushed/commit/" in capsys.readouterr().out

    # (The test hub keeps one set of files for all branches: each push below changes a file.)
    (saved / "notes.txt").write_text("for the dev branch")
    assert cli.main(["push", str(saved), "user/pushed", "--revision", "dev"]) == 0
    assert "dev" in repo.branches and repo.commit_revisions[-1] == "dev"
    (saved / "notes.txt").write_text("for a pull request")
    assert cli.main(["push", str(saved), "user/pushed", "--create-pr"]) == 0
    assert repo.pull_requests and f"{hub.url}/user/pushed/discussions/1" in capsys.readouterr().out


def test_push_to_hub_checks_the_token_before_quantizing(hub, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    argv = ["quantize", str(tiny_llama_dir), "--scheme", "int8", "--out", str(out), "--push-to-hub", "user/x"]
    assert cli.main(argv + ["--token", "hf_wrong"]) == 2
    assert "does not accept this token (401)" in capsys.readouterr().err
    monkeypatch.delenv("HF_TOKEN")
    assert cli.main(argv) == 2
    assert "pushing needs a Hub token" in capsys.readouterr().err
    assert cli.main(argv[:-1] + ["not a repo id"]) == 2
    assert "not a Hub repo id" in capsys.readouterr().err
    assert not out.exists() and not hub.repos  # nothing quantized, nothing created


def test_a_failed_push_says_what_was_saved_and_how_to_retry(hub, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi

    def no_network(self, **kwargs):
        raise ConnectionError("[Errno 101] Network is unreachable")

    monkeypatch.setattr(HfApi, "upload_folder", no_network)
    out = tmp_path / "o"
    argv = ["quantize", str(tiny_llama_dir), "--scheme", "int8", "--out", str(out), "--push-to-hub", "user/x",
            "--private"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"the checkpoint is saved in {out}, but pushing it to user/x failed" in err
    assert f"retry with: hf-aoq push {out} user/x --private" in err
    assert AutoModelForCausalLM.from_pretrained(out) is not None


def test_the_hub_base_models_license_is_carried_over(hub, tiny_llama_dir, tmp_path, capsys):
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo("user/licensed")
    api.upload_folder(folder_path=str(tiny_llama_dir), repo_id="user/licensed")
    api.upload_file(path_or_fileobj=b"---\nlicense: apache-2.0\n---\n# Base\n", path_in_repo="README.md",
                    repo_id="user/licensed")
    out = tmp_path / "q"
    assert cli.main(["quantize", "user/licensed", "--scheme", "int8", "--out", str(out), "--no-measure"]) == 0
    meta = yaml.safe_load((out / "README.md").read_text().split("---\n", 2)[1])
    assert meta["license"] == "apache-2.0" and meta["base_model"] == "user/licensed"
    assert meta["pipeline_tag"] == "text-generation"


def test_a_hub_id_the_hub_does_not_have_is_said_before_loading(hub, tmp_path, capsys):
    argv = ["quantize", "user/nothing-here", "--scheme", "int8", "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"user/nothing-here: no such model on {hub.url} (check the spelling)" in err, err
    from huggingface_hub import HfApi

    HfApi().create_repo("user/exists")
    argv[1] = "user/exists"
    assert cli.main(argv + ["--revision", "v9"]) == 2
    assert "user/exists has no revision 'v9'" in capsys.readouterr().err
