"""The workload fuzzer: runs seeded random cases (fuzz_case.py) against the engine and checks, after
every case, that nothing went wrong that a user could see or that the books could hide.

    python tests/fuzz/fuzzer.py --seed 17           # replay one case
    python tests/fuzz/fuzzer.py --minutes 30        # cases 0, 1, 2, ... until the time is up
    python tests/fuzz/fuzzer.py --minutes 30 --start 5000 --json out.json
    python tests/fuzz/fuzzer.py --minutes 30 --quick --triton   # every case on the Triton kernels, cascade on

Per case: one engine with the case's options (and, in some cases, random LoRA adapters that requests
run under), driven by the main thread (add_request, step and
aborts, the books audited after every step) while caller threads run generate() batches on it.
Checked:
- greedy tokens equal a reference engine's with caches and options off (aborted requests: a prefix);
- a bad request raises its typed error (in generate(), naming the prompt) and nothing else changes;
- no leaks: every KV block free, no encoder entry referenced, the books agree with the tensors;
- at most one encoder run per distinct item when the encoder cache can hold them all;
- no image re-encoded after a prefix hit, and no "no progress";
- a weight update with requests in flight (the checkpoint's own weights again, so the tokens stay the
  reference's: what is checked is the reset rule's books, tests/test_weight_update.py checks staleness);
- hostile video containers (ffconcat, HLS, SDP) refused by their typed error.
A failure names its seed and the command that replays it.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

if not torch.cuda.is_available():  # as in tests/conftest.py: before any kernel is decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for books.py

from books import assert_books_consistent  # noqa: E402
from hostile_media import hostile_payloads  # noqa: E402
from fuzz_case import CLIPS, DEFECTS, MAX_IMAGES, MAX_MODEL_LEN, FuzzCase, RequestSpec, make_case  # noqa: E402

import mmengine.errors  # noqa: E402
from mmengine import LoRARequest, MMEngine, RequestOutput, SamplingParams, StructuredOutputParams  # noqa: E402
from mmengine.testing import make_test_image  # noqa: E402
from mmengine.testing.eagle3 import build_eagle3_head  # noqa: E402
from mmengine.testing.families import tiny_checkpoint_path  # noqa: E402
from mmengine.testing.lora import build_random_adapter  # noqa: E402
from mmengine.testing.mtp import tiny_qwen3_5_mtp_path  # noqa: E402
from mmengine.testing.video import make_test_clip  # noqa: E402

REPLAY = "python tests/fuzz/fuzzer.py --seed {seed}"


class FuzzFailure(AssertionError):
    def __init__(self, case: FuzzCase, reason: str) -> None:
        replay = REPLAY.format(seed=case.seed) + (" --quick" if case.quick else "") + (" --triton" if case.triton else "")
        super().__init__(f"fuzz case {case.summary()}\n{reason}\nreplay: {replay}")


@dataclass
class CaseReport:
    seed: int
    family: str
    requests: int = 0
    bad_requests: int = 0
    aborted: int = 0
    steps: int = 0
    tokens_checked: int = 0
    encoder_runs: int = 0
    distinct_items: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    cascade_steps: int = 0
    encoder_evictions: int = 0
    kv_evictions: int = 0
    adapters: int = 0
    lora_slot_loads: int = 0
    weight_updates: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_method: str | None = None  # what drafted (None: no speculation)


@dataclass
class _Built:
    """A request spec made concrete: what the engine is given, and what the reference made of it."""

    spec: RequestSpec
    images: list[Any]
    uuids: list[str | None] | None
    params: SamplingParams
    lora: str | None = None  # the adapter's name
    videos: list[Any] = field(default_factory=list)  # the spec's clip, as frames
    prompt: Any = None  # what the engine is given: the text, or a prompt dict (see RequestSpec.prompt_form)
    expected_error: type[Exception] | None = None
    expanded_ids: list[int] = field(default_factory=list)  # the prompt's ids, placeholders expanded
    num_prompt_tokens: int = 0
    items: dict[str, int] = field(default_factory=dict)  # mm_hash -> embeddings
    reference: list[int] = field(default_factory=list)


class FuzzEnv:
    """The checkpoints and one reference engine per family, kept across cases."""

    def __init__(self, checkpoint: Callable[[str], Path] | None = None) -> None:
        self.checkpoint = checkpoint or default_checkpoint
        self._references: dict[str, MMEngine] = {}

    def reference(self, family: str) -> MMEngine:
        if family not in self._references:
            self._references[family] = MMEngine(
                str(self.checkpoint(family)), max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False,
                enable_prefix_grouping=False, cascade_attention="off", async_scheduling="off", device="cpu",
                dtype="float32", limit_mm_per_prompt={"image": MAX_IMAGES, "video": 1}, max_num_batched_tokens=4096,
            )
        return self._references[family]


def default_checkpoint(family: str) -> Path:
    return tiny_checkpoint_path(family)


def run_case(case: FuzzCase, env: FuzzEnv) -> CaseReport:
    """Runs one case; raises FuzzFailure (with the seed and a replay command) if anything is wrong."""
    try:
        with tempfile.TemporaryDirectory(prefix="mmengine-fuzz-") as tmp:
            return _run(case, env, Path(tmp))
    except FuzzFailure:
        raise
    except BaseException as exc:  # noqa: BLE001 - any crash is a finding
        raise FuzzFailure(case, "".join(traceback.format_exception(exc))) from exc


def _run(case: FuzzCase, env: FuzzEnv, tmp: Path) -> CaseReport:
    checkpoint = env.checkpoint(case.family)
    adapters = _adapters(case, checkpoint, tmp)
    reference = env.reference(case.family) if not adapters else _lora_reference(checkpoint, adapters)
    built = _build(case, tmp)
    _expect(case, built, reference)
    valid = [b for b in built if b.expected_error is None]
    # Half the cases keep evicted encoder outputs, half evicted KV blocks, in host tiers (drawn apart from the case's own draws)
    tiers = random.Random(f"{case.seed}-host-tier")
    # the Triton kernels run compiled on a GPU, in the interpreter on a CPU
    device = "cuda" if case.options.get("attn_backend") == "triton" and torch.cuda.is_available() else "cpu"
    speculation, checkpoint = _speculation(case, checkpoint, tmp)
    engine = MMEngine(str(checkpoint), device=device, dtype="float32", encoder_cache_host_bytes=tiers.choice((0, 1 << 20)),
                      kv_cache_host_bytes=tiers.choice((0, 1 << 20)), **(_resolve(case, valid) | speculation))
    for name, path in adapters.items():
        engine.add_lora(LoRARequest(name, str(path)))
    audit_lock = engine.lock  # the engine's own lock: an audit never sees a step half done

    def audit() -> None:
        with audit_lock:
            assert_books_consistent(engine)

    report = CaseReport(case.seed, case.family, requests=len(built), bad_requests=len(built) - len(valid),
                        spec_method=speculation.get("speculative_config", {}).get("method"))
    driver = built[: len(case.driver)]
    outputs: dict[int, RequestOutput] = {}
    rest = iter(built[len(case.driver):])
    caller_specs = [[[next(rest) for _ in call] for call in calls] for calls in case.callers]
    # A third of the cases update the weights (to the same values) after a few of the driver's steps
    updates = random.Random(f"{case.seed}-weight-update")
    update_at = updates.randint(1, 8) if updates.random() < 0.3 else None
    with ThreadPoolExecutor(max(1, len(caller_specs))) as pool:
        futures = [pool.submit(_call, engine, calls) for calls in caller_specs]
        driven, report.aborted, report.weight_updates = _drive(case, engine, driver, audit, update_at, checkpoint)
        for future in futures:
            for b, output in future.result():
                outputs[id(b)] = output
    for b, output in zip(driver, driven):
        if output is not None:
            outputs[id(b)] = output
    for _ in range(100):  # an async step may still be in flight with nothing left to return
        if not engine.has_unfinished_requests():
            break
        engine.step()
    _check(case, engine, built, outputs, report)
    return report


def _adapters(case: FuzzCase, checkpoint: Path, tmp: Path) -> dict[str, Path]:
    """The case's random LoRA adapters, written in PEFT's format, by name."""
    return {
        f"a{i}": build_random_adapter(checkpoint, tmp / f"adapter-{i}", a.rank, a.targets, seed=a.seed, scale=0.3)
        for i, a in enumerate(case.adapters)
    }


def _lora_reference(checkpoint: Path, adapters: dict[str, Path]) -> MMEngine:
    """A reference engine with every adapter in its own slot (caches and options off, as FuzzEnv's)."""
    engine = MMEngine(
        str(checkpoint), max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, enable_prefix_grouping=False,
        cascade_attention="off", async_scheduling="off", device="cpu", dtype="float32",
        limit_mm_per_prompt={"image": MAX_IMAGES, "video": 1}, max_num_batched_tokens=4096,
        enable_lora=True, max_loras=len(adapters), max_lora_rank=8,
    )
    for name, path in adapters.items():
        engine.add_lora(LoRARequest(name, str(path)))
    return engine


def _build(case: FuzzCase, tmp: Path) -> list[_Built]:
    """Every request's images in the forms it names, its uuids and params, defects applied."""
    objects = [make_test_image(p.seed, size=p.size) for p in case.pictures]
    pngs = []
    for i, picture in enumerate(objects):
        buffer = io.BytesIO()
        picture.save(buffer, "PNG")
        pngs.append(buffer.getvalue())
        (tmp / f"{i}.png").write_bytes(pngs[-1])

    def form(index: int, how: str) -> Any:
        return {
            "object": lambda: objects[index],
            "copy": lambda: objects[index].copy(),
            "png": lambda: pngs[index],
            "path": lambda: str(tmp / f"{index}.png"),
            "array": lambda: np.asarray(objects[index]).copy(),
        }[how]()

    built = []
    for index, spec in enumerate(case.requests()):
        images = [form(i, how) for i, how in zip(spec.pictures, spec.forms)]
        named = [case.pictures[i].uuid for i in spec.pictures]
        uuids = named if spec.use_uuids and any(named) else None
        if spec.defect == "corrupt":
            images[0] = pngs[spec.pictures[0]][:60]
        elif spec.defect == "count":
            images.pop()
        elif spec.defect == "image_type":
            images[0] = {"not": "an image"}
        elif spec.defect == "uuids":
            uuids = [None] * (len(images) + 1)
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True, **_sampling_extras(case, index))
        lora = "no-such-adapter" if spec.defect == "unknown_adapter" else (None if spec.lora is None else f"a{spec.lora}")
        videos = [make_test_clip(CLIPS[spec.clip][0], 40, 56, seed=CLIPS[spec.clip][1])] if spec.clip is not None else []
        if spec.defect == "hostile_video":  # naming a real file of the case's, and a port
            videos = [hostile_payloads(str(tmp / "0.png"), 45678)[spec.hostile]]
        built.append(_Built(spec, images, uuids, params, lora, videos))
    return built


def _sampling_extras(case: FuzzCase, index: int) -> dict[str, Any]:
    """Some requests are constrained by a grammar or penalized (drawn apart from the workload's own
    draws, so a seed's workload stays what it was): the reference runs them the same way."""
    rng = random.Random(f"{case.seed}-sampling-{index}")
    extras: dict[str, Any] = {}
    if rng.random() < 0.15:
        extras["structured_output"] = rng.choice((
            StructuredOutputParams(regex="[a-z ]{1,12}"), StructuredOutputParams(choice=["yes", "no", "maybe not"]),
            StructuredOutputParams(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                                         "required": ["n"], "additionalProperties": False})))
    if rng.random() < 0.15:
        extras |= {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2}
    return extras


def _expect(case: FuzzCase, built: list[_Built], reference: MMEngine) -> None:
    """What each request must give: the reference engine's verdict on its input (a typed error, which
    a defect must produce) and, for the valid ones, its greedy tokens."""
    for b in built:
        try:
            processed = reference.input_processor.process(b.spec.prompt, b.images, b.params, mm_uuids=b.uuids, videos=b.videos)
        except mmengine.errors.InvalidInputError as err:
            b.expected_error = type(err)
        else:
            b.num_prompt_tokens = len(processed.prompt_token_ids)
            b.items = {item.mm_hash: item.length for item in processed.mm_items}
            b.expanded_ids = processed.prompt_token_ids
        b.prompt = _engine_prompt(b, reference)
        if b.spec.defect == "unknown_adapter":  # refused before its input is looked at
            b.expected_error = mmengine.errors.UnknownAdapterError
        if b.spec.defect is not None:
            wanted = getattr(mmengine.errors, DEFECTS[b.spec.defect])
            if b.expected_error is None or not issubclass(b.expected_error, wanted):
                raise FuzzFailure(case, f"the reference gave {b.expected_error} for a {b.spec.defect!r} defect, not {wanted.__name__}")
    valid = [b for b in built if b.expected_error is None]
    if valid:
        outs = reference.generate(
            [b.spec.prompt for b in valid], images=[b.images for b in valid], sampling_params=[b.params for b in valid],
            mm_uuids=[b.uuids for b in valid], lora=[b.lora for b in valid] if case.adapters else None, use_tqdm=False,
            videos=[b.videos or None for b in valid],
        )
        for b, out in zip(valid, outs):
            b.reference = out.token_ids


def _engine_prompt(b: _Built, reference: MMEngine) -> Any:
    """The prompt in the spec's form: its text, or a dict whose multi_modal_data carries the images."""
    form = b.spec.prompt_form
    if form == "text":
        return b.spec.prompt
    data = {"multi_modal_data": {"image": b.images}} if b.images else {}
    if b.videos:
        data = {"multi_modal_data": data.get("multi_modal_data", {}) | {"video": b.videos}}
    if form == "dict":
        return {"prompt": b.spec.prompt, **data}
    ids = reference.tokenizer(b.spec.prompt)["input_ids"] if form == "markers" else b.expanded_ids
    return {"prompt_token_ids": list(ids), **data}


def _images_arg(b: _Built) -> list[Any] | None:
    """The images= argument beside the prompt: none when a prompt dict carries them."""
    return b.images if isinstance(b.prompt, str) else None


def _videos_arg(b: _Built) -> list[Any] | None:
    return b.videos if isinstance(b.prompt, str) and b.videos else None


# families a draft head drafts for: their own MTP head (the tiny checkpoint's copy with a random one), or an EAGLE-3
# head built for the case (those on the Llama-like decoder)
MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe")
EAGLE3_FAMILIES = ("llava", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "internvl", "mistral3",
                   "llava_onevision")


def _speculation(case: FuzzCase, checkpoint: Path, tmp: Path) -> tuple[dict[str, object], Path]:
    """A third of the cases speculate (drawn apart from the case's own draws): with n-gram lookup, or, for half
    of those on a family that has one, a random draft head (Qwen3.5's MTP head, or an EAGLE-3 head); with the
    back-off or without. The tokens are the reference's all the same, and drafts that find no free blocks are
    dropped before anyone is preempted. The case's async scheduling draw stands (a step whose successor drafts
    is read first). Returns the options and the checkpoint to run (an MTP head's copy of the case's)."""
    rng = random.Random(f"{case.seed}-speculative")
    if rng.random() >= 1 / 3:
        return {}, checkpoint
    k = rng.randint(1, 4)
    spec: dict[str, object] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                               "prompt_lookup_max": rng.randint(1, 3)}
    # (not on the Triton interpreter: the head's attention runs the kernels the target's does, at a cost the suite feels)
    interpreted = case.options.get("attn_backend") == "triton" and not torch.cuda.is_available()
    if rng.random() < 0.5 and case.family in MTP_FAMILIES and not interpreted:
        spec, checkpoint = {"method": "mtp", "num_speculative_tokens": k}, tiny_qwen3_5_mtp_path(case.family)
    elif rng.random() < 0.5 and case.family in EAGLE3_FAMILIES and not interpreted:
        head = build_eagle3_head(tmp / "eagle3", checkpoint, draft_vocab_size=rng.choice((None, 150)),
                                 own_embeddings=rng.random() < 0.5, seed=case.seed)
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
    spec["draft_backoff"] = rng.random() < 0.5
    return {"speculative_config": spec}, checkpoint


def _resolve(case: FuzzCase, valid: list[_Built]) -> dict[str, object]:
    """The case's options with the sizes that need model facts: the KV cache from the longest request
    up, the encoder cache from the largest item up (or autotuned)."""
    options = dict(case.options)
    block_size = int(options["block_size"])
    longest = max((b.num_prompt_tokens + b.spec.max_tokens for b in valid), default=1)
    options["num_kv_blocks"] = math.ceil(longest / block_size) + case.kv_blocks_extra
    if case.encoder_items_extra is not None:
        largest = max((n for b in valid for n in b.items.values()), default=1)
        options["encoder_cache_size"] = largest * (1 + case.encoder_items_extra)
    return options


def _drive(
    case: FuzzCase, engine: MMEngine, driver: list[_Built], audit: Callable[[], None], update_at: int | None, checkpoint: Path,
) -> tuple[list[RequestOutput | None], int, int]:
    """The main thread's share: adds its requests one by one between steps, aborts some of them
    while they run, updates the weights after step `update_at` (if not None), and audits the books
    after every step."""
    updates = 0
    rng = random.Random(case.seed ^ 0x5EED)
    outputs: list[RequestOutput | None] = [None] * len(driver)
    queue = list(range(len(driver)))
    live: dict[str, list[int]] = {}  # request id -> [index, steps since added]
    aborted = 0
    budget = 200 + 50 * sum(b.num_prompt_tokens + b.spec.max_tokens for b in driver)
    steps = 0
    while queue or live:
        if queue and (not live or rng.random() < 0.5):
            index = queue.pop(0)
            b = driver[index]
            try:
                request_id = engine.add_request(b.prompt, _images_arg(b), b.params, cache_salt=b.spec.salt, mm_uuids=b.uuids,
                                                lora=b.lora, videos=_videos_arg(b))
            except mmengine.errors.InvalidInputError as err:
                _check_error(case, b, err, None)
                continue
            if b.expected_error is not None:
                raise FuzzFailure(case, f"add_request accepted a request the reference refuses ({b.expected_error.__name__})")
            live[request_id] = [index, 0]
            continue
        for output in engine.step():
            if output.finished and output.request_id in live:
                outputs[live.pop(output.request_id)[0]] = output
        steps += 1
        if steps > budget:
            raise FuzzFailure(case, f"no progress: {steps} steps and requests {sorted(live)} still running")
        audit()
        if steps == update_at:
            engine.update_weights(str(checkpoint))
            updates += 1
            audit()
        for request_id, entry in list(live.items()):
            entry[1] += 1
            after = driver[entry[0]].spec.abort_after_steps
            if after is not None and entry[1] > after and engine.abort_request(request_id):
                aborted += 1
                driver[entry[0]].spec.abort_after_steps = None
    return outputs, aborted, updates


def _call(engine: MMEngine, calls: list[list[_Built]]) -> list[tuple[_Built, RequestOutput]]:
    """A caller thread's generate() calls, one after another: a call with a bad request must raise
    that request's error (the first in input order, naming its prompt) and queue nothing; it is
    then made again without its bad requests."""
    results = []
    for call in calls:
        bad = [i for i, b in enumerate(call) if b.expected_error is not None]
        if bad:
            try:
                _generate(engine, call)
            except mmengine.errors.InvalidInputError as err:
                first = call[bad[0]]
                if not isinstance(err, first.expected_error) or err.prompt_index != bad[0]:
                    raise AssertionError(f"generate() raised {err!r} for a batch whose first bad prompt is {bad[0]} ({first.expected_error.__name__})") from err
            else:
                raise AssertionError(f"generate() accepted a batch with bad prompts {bad}")
            call = [b for b in call if b.expected_error is None]
        if call:
            outs = _generate(engine, call)
            assert [o.prompt_token_ids for o in outs] == [b.expanded_ids for b in call], "generate() outputs out of input order"
            results += zip(call, outs)
    return results


def _generate(engine: MMEngine, call: list[_Built]) -> list[RequestOutput]:
    return engine.generate(
        [b.prompt for b in call], images=[_images_arg(b) for b in call], sampling_params=[b.params for b in call],
        cache_salt=[b.spec.salt for b in call], mm_uuids=[b.uuids for b in call], lora=[b.lora for b in call],
        use_tqdm=False, videos=[_videos_arg(b) for b in call],
    )


def _check_error(case: FuzzCase, b: _Built, err: Exception, index: int | None) -> None:
    if b.expected_error is None:
        raise FuzzFailure(case, f"a valid request was refused: {err!r}")
    if not isinstance(err, b.expected_error):
        raise FuzzFailure(case, f"expected {b.expected_error.__name__}, got {err!r}")


def _check(case: FuzzCase, engine: MMEngine, built: list[_Built], outputs: dict[int, RequestOutput], report: CaseReport) -> None:
    """Tokens against the reference, then the books and the work counts."""
    for b in built:
        output = outputs.get(id(b))
        if b.expected_error is not None:
            continue
        if output is None:
            raise FuzzFailure(case, f"no output for {b.spec.prompt[-60:]!r}")
        if output.prompt_token_ids != b.expanded_ids:
            raise FuzzFailure(case, f"prompt given as {b.spec.prompt_form!r}: its ids differ from the text's expansion")
        if output.finish_reason == "abort":
            if output.token_ids != b.reference[: len(output.token_ids)]:
                raise FuzzFailure(case, f"aborted request's tokens {output.token_ids} are not a prefix of {b.reference}")
        elif output.token_ids != b.reference:
            raise FuzzFailure(
                case, f"tokens differ from the reference for prompt {b.spec.prompt[-80:]!r} with pictures "
                f"{b.spec.pictures} as {b.spec.forms}: {output.token_ids} != {b.reference}"
            )
        report.tokens_checked += len(output.token_ids)
    stats = engine.stats()
    if engine.has_unfinished_requests():
        raise FuzzFailure(case, "requests left unfinished")
    assert_books_consistent(engine)
    problems = []
    if stats["kv_blocks_free"] != stats["kv_blocks_total"]:
        problems.append(f"{stats['kv_blocks_total'] - stats['kv_blocks_free']} KV blocks still held")
    if engine.encoder_cache.num_referenced:
        problems.append(f"{engine.encoder_cache.num_referenced} encoder embeddings still referenced")
    if stats["reencodes_after_prefix_hit"]:
        problems.append(f"{stats['reencodes_after_prefix_hit']} re-encodes after a prefix hit")
    distinct: dict[str, int] = {}
    for b in built:
        distinct.update(b.items)
    most_runs = len(distinct) * (1 + report.weight_updates)  # an update of the towers encodes every item again
    if engine.encoder_cache.capacity >= sum(distinct.values()) and stats["encoder_runs"] > most_runs:
        problems.append(f"{stats['encoder_runs']} encoder runs for {len(distinct)} distinct items, all of which fit the cache")
    if problems:
        raise FuzzFailure(case, "; ".join(problems))
    report.steps = stats["steps"]
    report.encoder_runs = stats["encoder_runs"]
    report.distinct_items = len(distinct)
    report.prefix_cache_hits = stats["prefix_cache_hits"]
    report.preemptions = stats["num_preemptions"]
    report.cascade_steps = stats["cascade_steps"]
    report.encoder_evictions = stats["encoder_cache_evictions"]
    report.kv_evictions = stats["kv_blocks_evicted"]
    report.adapters = len(case.adapters)
    report.lora_slot_loads = stats.get("lora_slot_loads", 0)
    report.spec_draft_tokens = stats["spec_draft_tokens"]
    report.spec_accepted_tokens = stats["spec_accepted_tokens"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, help="replay this one case")
    parser.add_argument("--minutes", type=float, default=1.0, help="run cases from --start until the time is up")
    parser.add_argument("--start", type=int, default=0, help="first seed of a timed run")
    parser.add_argument("--quick", action="store_true", help="the small cases of the suite's seeded test")
    parser.add_argument("--triton", action="store_true", help="every case on the Triton kernels with cascade on")
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args(argv)
    budget_log = logging.getLogger("mmengine.encoder_cache.budget")
    level = budget_log.level
    budget_log.setLevel(logging.ERROR)  # "encoder_cache_size ... raised to one item" is expected here
    try:
        return _main(args)
    finally:
        budget_log.setLevel(level)


def _main(args: argparse.Namespace) -> int:
    env = FuzzEnv()
    if args.seed is not None:
        case = make_case(args.seed, quick=args.quick, triton=args.triton)
        print(case.summary())
        print(json.dumps(asdict(run_case(case, env))))
        return 0
    deadline = time.monotonic() + 60 * args.minutes
    reports, failures, seed = [], [], args.start
    while time.monotonic() < deadline:
        case = make_case(seed, quick=args.quick, triton=args.triton)
        try:
            reports.append(run_case(case, env))
        except FuzzFailure as failure:
            failures.append({"seed": seed, "error": str(failure)})
            print(f"FAILED {failure}", flush=True)
        seed += 1
        if seed % 25 == 0:
            print(f"{seed - args.start} cases, {len(failures)} failed", flush=True)
    totals = {key: sum(getattr(r, key) for r in reports) for key in CaseReport.__dataclass_fields__
              if key not in ("seed", "family", "spec_method")}
    by_family = {f: sum(r.family == f for r in reports) for f in sorted({r.family for r in reports})}
    totals["by_spec_method"] = {m: sum((r.spec_method or "none") == m for r in reports) for m in sorted({r.spec_method or "none" for r in reports})}
    summary = {"cases": len(reports) + len(failures), "passed": len(reports), "failed": len(failures), "seeds": [args.start, seed - 1],
               "minutes": args.minutes, "threads_at_end": threading.active_count(), "by_family": by_family, "totals": totals, "failures": failures}
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=1))
    for failure in failures:
        print(f"seed {failure['seed']}: {REPLAY.format(seed=failure['seed'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
