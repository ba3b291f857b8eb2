"""The conductor's tokenizer without a node's path: from a Hugging Face hub id in the HF
cache (offline, the cache's own layout: ``models--org--name/{refs,snapshots}``), from
``--tokenizer``, or a shipped model's name; one that is not the nodes' (by name) is
refused with FAILED_PRECONDITION, and a hub id missing from an offline cache says so.
Run in a fresh interpreter: huggingface_hub reads HF_HUB_CACHE/HF_HUB_OFFLINE at import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

from kvmesh.services.common.tokenizer import HFTokenizer
from kvmesh.services.engine.model_spec import shipped_model_dir

REPO = "kvmesh-test/demo-tokenizer"
FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")


def _hub_cache(root) -> str:
    """An HF hub cache holding ``REPO``'s tokenizer files (the shipped demo's)."""
    org, name = REPO.split("/")
    repo = root / f"models--{org}--{name}"
    commit = "3" * 40
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in FILES:
        shutil.copy(os.path.join(shipped_model_dir("demo"), f), snap / f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return str(root)


SCRIPT = textwrap.dedent(
    """
    import grpc
    from kvmesh.services.common.tokenizer import TokenizerError, load_tokenizer
    from kvmesh.services.conductor.frontend import Rejected
    from kvmesh.services.conductor.request_input import RequestInput

    REPO, DEMO = {repo!r}, {demo!r}
    tok = load_tokenizer(REPO, hub=True)
    assert tok.name == DEMO, tok.name
    assert tok.encode("hello world") == load_tokenizer("demo").encode("hello world")

    # the node's model directory is not on this machine: the model's name is a hub id
    ri = RequestInput(None, 100, 0)
    far = {{"model": REPO, "model_path": "/not/on/this/machine", "tokenizer": DEMO}}
    assert ri.tokenizer(far).name == DEMO
    # --tokenizer, whatever the model is called
    ri = RequestInput(None, 100, 0, tokenizer=REPO)
    assert ri.tokenizer({{"model": "my-own-name", "tokenizer": DEMO}}).name == DEMO
    # a tokenizer that is not the nodes' is refused
    try:
        ri.tokenizer({{"model": "my-own-name", "tokenizer": "byte-v1"}})
        raise SystemExit("a tokenizer other than the nodes' was used")
    except Rejected as e:
        assert e.code == grpc.StatusCode.FAILED_PRECONDITION and "--tokenizer" in e.message
    # offline, a hub id not in the cache says where it looked and why nothing came
    try:
        load_tokenizer("kvmesh-test/absent", hub=True)
        raise SystemExit("an absent hub id loaded")
    except TokenizerError as e:
        assert "not in the Hugging Face cache" in str(e) and "HF_HUB_OFFLINE" in str(e), e
    ri = RequestInput(None, 100, 0)
    try:
        ri.tokenizer({{"model": "kvmesh-test/absent", "tokenizer": DEMO}})
        raise SystemExit("an absent tokenizer did not refuse")
    except Rejected as e:
        assert e.code == grpc.StatusCode.FAILED_PRECONDITION and "--tokenizer" in e.message
    print("ok")
    """
)


def test_tokenizer_from_an_offline_hub_cache(tmp_path):
    demo = HFTokenizer(shipped_model_dir("demo")).name
    env = {
        **os.environ,
        "HF_HUB_CACHE": _hub_cache(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "home"),
    }
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(repo=REPO, demo=demo)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
