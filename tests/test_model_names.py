"""Model names: the shipped ``demo`` model (a small Llama trained on public-domain English)
and Hugging Face hub ids resolved from a hub cache that the test builds itself, offline.

The oracle for both: greedy output through a real cluster (etcd, services in their own
processes, gRPC, KV over the transfer engine) equals the same weights generating from
scratch in this process, token for token."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common.tokenizer import HFTokenizer
from kvmesh.services.engine.checkpoint import (
    CheckpointError,
    load_model,
    resolve_model,
    shipped_model_dir,
)
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, generate

transformers = pytest.importorskip("transformers")
from tests.test_checkpoint import build  # noqa: E402

HUB_ID = "kvmesh-test/tiny-llama"
REV = "0123456789abcdef0123456789abcdef01234567"
# common English words: a model that writes English uses several of them in 24 tokens
COMMON = set(
    "the of and a to in is it that which his he be as with for by not or an are was "
    "this one who from at on have but their they all its no has what so".split()
)
SHARED = "A lawyer is a person who knows the law, and the devil is a person who knows "
PROMPTS = [
    "Hello, kvmesh",
    "The quick brown fox jumps over the lazy dog.",
    SHARED + "the lawyer.",
    SHARED + "the world, and the world is",
]
MAX_TOKENS = 16


def _subprocess_env(hf_home: Path, offline: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1" if offline else "0")
    env.pop("TRANSFORMERS_OFFLINE", None)
    return env


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> tuple[Path, Path]:
    """HF_HOME holding one model, ``kvmesh-test/tiny-llama``, in the hub cache layout
    (hub/models--org--name/refs/main naming snapshots/<rev>/)."""
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True)
    build(snap, "llama", seed=5)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return home, snap


# ---------------------------------------------------------------- the demo model
def test_demo_is_a_small_trained_llama_with_its_tokenizer_and_provenance():
    path = Path(shipped_model_dir("demo"))
    assert resolve_model("demo") == str(path)
    weights = path / "model.safetensors"
    assert weights.stat().st_size <= 10 * 2**20  # at most ~10 MiB of bfloat16
    with safe_open(str(weights), framework="pt") as st:
        assert {str(st.get_slice(k).get_dtype()) for k in st.keys()} == {"BF16"}
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    source = (path / "SOURCE.md").read_text()
    assert "public domain" in source.lower() and "dict-devil" in source
    assert hashlib.sha256(weights.read_bytes()).hexdigest() in source
    lm = load_model("demo")
    assert lm.name == "demo" and lm.path == str(path)
    assert isinstance(lm.tokenizer, HFTokenizer)


def test_demo_speaks_english_greedily():
    lm = load_model("demo")
    tok = lm.tokenizer
    for prompt in ("Hello, kvmesh", "The cat"):
        text = tok.decode(lm.model.reference_generate(tok.encode(prompt), 24, tok.eos_id))
        words = re.findall(r"[a-z]+", text.lower())
        assert len(COMMON.intersection(words)) >= 2, text


@pytest.fixture(scope="module")
def demo_cluster(tmp_path_factory):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("demo-cluster")),
        node_args=["--model", "demo", *NODE_ARGS],
        conductor_args=DISAGG_ONLY,
    )
    c.start()
    yield c
    c.stop()


def test_demo_through_the_cluster_is_token_exact(demo_cluster):
    lm = load_model("demo")
    tok = lm.tokenizer
    cached = 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ref = lm.model.reference_generate(ids, MAX_TOKENS, tok.eos_id)
        got = generate(demo_cluster.conductor, prompt, max_tokens=MAX_TOKENS)
        assert got.tokens == ref, prompt
        assert got.usage.prompt_tokens == len(ids)
        assert got.text == tok.decode(ref)
        cached = got.usage.cached_tokens
    assert cached > 0  # the last prompt's shared prefix came from the cache


# ---------------------------------------------------------------- hub ids
def test_local_directory_and_names_win_over_the_hub(tmp_path, monkeypatch):
    """A relative directory spelled like a hub id is that directory (as `vllm serve`)."""
    local = tmp_path / "kvmesh-test" / "tiny-llama"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model(HUB_ID) == str(local)
    assert resolve_model("tiny") == "tiny"
    with pytest.raises(
        CheckpointError, match=r"tiny, small, medium, llama-1b, demo.*hub id \(org/name\)"
    ):
        resolve_model("no such model")


def test_hub_id_served_offline_from_the_cache(hub_cache, tmp_path, monkeypatch):
    """`--model org/name` with HF_HOME and HF_HUB_OFFLINE=1: every node loads the cached
    snapshot, the cluster serves it under the hub id, token-exact."""
    home, snap = hub_cache
    for k, v in _subprocess_env(home).items():
        monkeypatch.setenv(k, v)
    ref_model = load_model(str(snap))
    tok = ref_model.tokenizer
    prompt = "the cat sat on the mat and the dog"
    ref = ref_model.model.reference_generate(tok.encode(prompt), 8, None)
    with LocalCluster(
        str(tmp_path / "cluster"),
        node_args=["--model", HUB_ID, *NODE_ARGS],
        conductor_args=DISAGG_ONLY,
    ) as c:
        got = generate(
            c.conductor,
            prompt,
            max_tokens=8,
            model=HUB_ID,
            sampling=pb.SamplingParams(ignore_eos=True),
        )
    assert got.tokens == ref


def test_hub_id_missing_from_the_offline_cache_is_a_clear_error(hub_cache):
    home, _ = hub_cache
    missing = "kvmesh-test/not-downloaded"
    for argv in (["prefill", "--model", missing], ["up", "--model", missing, "--port", "0"]):
        r = subprocess.run(
            [sys.executable, "-m", "kvmesh.services.cli", *argv],
            env=_subprocess_env(home),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode != 0, r.stdout + r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert missing in r.stderr and "HF_HUB_OFFLINE" in r.stderr, r.stderr
        assert str(home / "hub") in r.stderr, r.stderr  # where it looked
    # the id that is in the cache resolves in a fresh process, to its snapshot
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kvmesh.services.engine.checkpoint import resolve_model as r; "
            f"print(r({HUB_ID!r}))",
        ],
        env=_subprocess_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(
        home / "hub" / "models--kvmesh-test--tiny-llama" / "snapshots" / REV
    )
