"""A fuzz case: an engine configuration and a workload, drawn from one seed (and nothing else).

The case is plain data. Sizes that depend on the model (how many tokens a picture becomes, how long
the longest prompt is) are not known here: the case says how far above the minimum to go
(`kv_blocks_extra`, `encoder_items_extra`), and `fuzzer.py` resolves that against the checkpoint.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from chat_formats import continue_chat, user_turn

# (in an order that brings every kind of request test_fuzz.py asks for into the suite's quick seeds: make_case(seed,
# quick=True) takes FAMILIES[seed % len(FAMILIES)])
FAMILIES = ("qwen3_5_moe", "llava", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "gemma3", "internvl",
            "mistral3", "llama4", "gemma4", "llava_onevision")
NO_LORA = ("qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "gemma4", "gemma3", "llama4")  # families that refuse LoRA adapters at start-up
# (the cases' clips are marked as Qwen's templates mark them)
NO_VIDEO = ("llava", "gemma4", "llava_onevision", "smolvlm", "gemma3", "internvl", "mistral3", "llama4")
# Token prompts with pictures a family refuses, as docs/models.md says (given as prompt dicts instead): SmolVLM's
# pictures make several items between text tokens (its tiles); Gemma 3 takes one <image_soft_token> a picture, not the
# template's <start_of_image>; Mistral 3 takes one [IMG] a picture, not the expanded rows broken by [IMG_BREAK]; Llama 4
# one <|patch|> a picture, neither the template's <|image|> nor the expanded text whose tile separators break the runs
REFUSED_TOKEN_PROMPTS = {"smolvlm": ("markers", "expanded"), "gemma3": ("markers",), "mistral3": ("expanded",),
                         "llama4": ("markers", "expanded")}
# Families whose prefill chunks hold a picture whole (it attends both ways): the token budget must hold the largest
WHOLE_PICTURE_BUDGET = {"gemma4": 96, "gemma3": 16}  # Gemma 4's pictures here are up to 70 tokens, Gemma 3's 16
# The families of the Triton cases, one per decoder the kernels run differently: the others' decoders run on the same
# kernels as one of these (Qwen2-VL's is Qwen2.5-VL's, Qwen3-VL-MoE's Qwen3-VL's attention and Qwen3.5-MoE's experts,
# Qwen3.5's Qwen3.5-MoE's hybrid layers; LLaVA-OneVision's, SmolVLM's, InternVL's and Mistral 3's the common decoder;
# Gemma 3's Gemma 4's window and span rules), and an interpreted case costs a minute of the suite. Each family's
# Triton path is checked against transformers in its own tests (test_family_engine.py, test_gemma4.py, ...). A quick
# seed s is a Triton case of TRITON_FAMILIES[s % len(TRITON_FAMILIES)] when s is one of TRITON_SEEDS
TRITON_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5_moe", "llava", "gemma4")
WORDS = (
    "the a cat dog red blue green look picture what is this why how small large left right top bottom "
    "colour shape count tell me more about it please describe short long first next again line box"
).split()
# How a picture is handed to the engine: the case's one PIL object for it (repeated objects), a
# fresh equal PIL image, PNG bytes, a PNG file's path, or a numpy array. All decode to the same pixels.
FORMS = ("object", "copy", "png", "path", "array")
# Bad requests and the error each must raise (names in mmengine.errors).
DEFECTS = {
    "corrupt": "CorruptImageError",  # one image is truncated PNG bytes
    "count": "ImageCountMismatchError",  # one image fewer than the prompt's markers
    "too_many": "TooManyImagesError",  # more images than limit_mm_per_prompt
    "too_long": "PromptTooLongError",  # longer than max_model_len
    "uuids": "InvalidInputError",  # mm_uuids of the wrong length
    "image_type": "UnsupportedImageTypeError",  # a dict where an image belongs
    "unknown_adapter": "UnknownAdapterError",  # a LoRA adapter name nobody registered
    # a video whose bytes would make FFmpeg open a file or a socket (ffconcat, HLS, SDP): families with videos
    "hostile_video": "UnsupportedContainerError",
}
# The hostile containers a "hostile_video" request may carry (tests/hostile_media.py)
HOSTILE_PAYLOADS = ("ffconcat", "ffconcat-concat-protocol", "hls", "hls-concat-protocol", "hls-file-protocol", "sdp")
MAX_IMAGES = 4  # limit_mm_per_prompt
MAX_MODEL_LEN = 640
# Quick cases on the Triton kernels with cascade on, one per family in TRITON_FAMILIES' order (the suite's seeds): the
# kernels run in Triton's interpreter on a CPU, so these cases keep to a few driver requests. Seeds 112, 118 and 184
# replace 102, 103 and 104: traced, they run every kernel line (mmengine/kernels) and launch every constexpr
# specialization that those did, in less of the interpreter's time (0.6x, 0.6x, 0.8x); cascade steps come in four of
# the cases (test_fuzz_triton.py)
TRITON_SEEDS = (100, 101, 112, 118, 184)
# Clips a Qwen case may show (frames, seed): 3 and 4 temporal patches of 2 frames, one padded
CLIPS = ((5, 1), (8, 2))
VIDEO_MARKER = "<|vision_start|><|video_pad|><|vision_end|>"


@dataclass(frozen=True)
class Picture:
    seed: int
    size: tuple[int, int]  # (width, height)
    uuid: str | None  # the mm_uuid that may name it (always this picture)


@dataclass
class RequestSpec:
    prompt: str
    pictures: list[int]  # indices into FuzzCase.pictures, in marker order
    forms: list[str]
    use_uuids: bool  # pass each named picture's uuid (None for the others)
    salt: str | None
    max_tokens: int
    defect: str | None = None
    abort_after_steps: int | None = None  # driver requests: aborted this many of its steps after being added
    lora: int | None = None  # index into FuzzCase.adapters; None: the base model
    # How the prompt is given: its text, a {"prompt": text} dict, or token ids with one placeholder per
    # picture ("markers") or the processor's expanded runs ("expanded"), pictures in multi_modal_data
    prompt_form: str = "text"
    clip: int | None = None  # index into CLIPS: a video before the text (Qwen families; text or dict prompts)
    hostile: str | None = None  # with the "hostile_video" defect: which of HOSTILE_PAYLOADS its video is


PROMPT_FORMS = ("text", "text", "dict", "markers", "expanded")


@dataclass(frozen=True)
class Adapter:
    """A random LoRA adapter (mmengine.testing.lora) the case registers."""

    rank: int
    targets: tuple[str, ...]
    seed: int


@dataclass
class FuzzCase:
    seed: int
    family: str
    options: dict[str, object]  # engine options that need no model facts
    kv_blocks_extra: int  # KV blocks above the minimum (the longest request's blocks)
    encoder_items_extra: int | None  # None: the autotuned encoder cache; else largest item x (1 + extra)
    pictures: list[Picture]
    driver: list[RequestSpec]  # added one by one between steps, in the main thread, with aborts
    callers: list[list[list[RequestSpec]]] = field(default_factory=list)  # per thread, its generate() calls
    quick: bool = False
    adapters: list[Adapter] = field(default_factory=list)  # with options' enable_lora
    triton: bool = False  # drawn for the Triton kernels with cascade on

    def requests(self) -> list[RequestSpec]:
        return self.driver + [spec for calls in self.callers for call in calls for spec in call]

    def summary(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return (
            f"seed {self.seed}: {self.family}, {len(self.requests())} requests ({len(self.driver)} driver, "
            f"{len(self.callers)} callers), {len(self.pictures)} pictures, kv +{self.kv_blocks_extra}, "
            f"encoder {'auto' if self.encoder_items_extra is None else f'+{self.encoder_items_extra}'}; {opts}"
        )


def turn(family: str, text: str, num_images: int, system: str | None = None, first: bool = True) -> str:
    """One user turn as the family's chat template writes it, images first, with an optional system text
    (`first`: the conversation's first turn, after which Gemma's and Mistral's templates write no <bos>)."""
    return user_turn(family, text, num_images, system, first)


def make_case(seed: int, quick: bool = False, triton: bool = False) -> FuzzCase:
    """The case of `seed`. `quick` keeps it small (the suite's seeded test); `triton` (or a quick seed of
    TRITON_SEEDS) runs it on the Triton kernels with cascade on, a few requests on one system text."""
    rng = random.Random(seed)
    triton = triton or (quick and seed in TRITON_SEEDS)
    families = TRITON_FAMILIES if quick and seed in TRITON_SEEDS else FAMILIES
    family = families[seed % len(families)] if quick else rng.choice(FAMILIES)
    prefix_caching = rng.random() < 0.8 or triton  # cascade groups requests by their cached blocks
    options: dict[str, object] = {
        "block_size": rng.choice((2, 4, 8, 16, 32)),
        "max_num_batched_tokens": rng.choice((8, 16, 24, 48, 96, 512)),
        "max_num_seqs": rng.randint(1, 8),
        "enable_prefix_caching": prefix_caching,
        "enable_prefix_grouping": prefix_caching and rng.random() < 0.6,
        "cascade_attention": rng.choice(("on", "off", "auto")),
        "async_scheduling": rng.choice(("on", "off")),
        "prefix_caching_hash_algo": rng.choice(("xxh3_128", "xxh3_128", "sha256")),
        "mm_processor_cache_bytes": rng.choice((0, 1 << 30)),
        "limit_mm_per_prompt": {"image": MAX_IMAGES, "video": 1},
        "max_model_len": MAX_MODEL_LEN,
    }
    if family in WHOLE_PICTURE_BUDGET:
        options["max_num_batched_tokens"] = max(int(options["max_num_batched_tokens"]), WHOLE_PICTURE_BUDGET[family])
    if triton:  # larger chunks and batches: fewer steps in the interpreter, and requests in flight together
        options |= {"attn_backend": "triton", "cascade_attention": "on", "max_num_seqs": max(3, int(options["max_num_seqs"])),
                    "max_num_batched_tokens": max(64, int(options["max_num_batched_tokens"]))}
    elif not quick and rng.random() < 0.1:
        options["attn_backend"] = "triton"  # Triton's interpreter on a CPU: slow, so only now and then
    adapters = []
    if rng.random() < 0.3 and family not in NO_LORA:
        projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        adapters = [Adapter(rng.choice((1, 2, 4, 8)), tuple(rng.sample(projections, rng.randint(1, 7))), 77 * seed + i)
                    for i in range(rng.randint(1, 4))]
        options |= {"enable_lora": True, "max_loras": rng.randint(1, 3), "max_lora_rank": 8, "max_cpu_loras": rng.choice((None, 4))}
        if options["max_cpu_loras"] is None:
            del options["max_cpu_loras"]
    num_pictures = rng.randint(2, 5 if quick else 40)
    pictures = [
        Picture(1000 * seed + i, (rng.randint(16, 100), rng.randint(16, 100)), f"pic-{seed}-{i}" if rng.random() < 0.3 else None)
        for i in range(num_pictures)
    ]
    systems = [_words(rng, rng.randint(4, 40)) for _ in range(rng.randint(1, 3))]
    if triton:  # one long system text in every request: their prefixes share blocks, so cascade groups them
        systems, options["block_size"] = [_words(rng, 30)], rng.choice((4, 8))
    draw = _Drawer(rng, family, pictures, systems, quick, repeat_rate=rng.choice((0.1, 0.5, 0.8)), num_adapters=len(adapters),
                   system_rate=1.0 if triton else 0.7)
    num_driver = 3 if triton else rng.randint(2, 6 if quick else 20)
    driver = [draw.request(driver=True) for _ in range(num_driver)]
    callers = []
    for _ in range(0 if triton else rng.randint(0, 2 if quick else 3)):
        calls, previous = [], []
        for _ in range(rng.randint(1, 2 if quick else 3)):
            call = [draw.request(earlier=previous) for _ in range(rng.randint(1, 3 if quick else 6))]
            calls.append(call)
            previous = [spec for spec in call if spec.defect is None]
        callers.append(calls)
    return FuzzCase(
        seed=seed,
        family=family,
        options=options,
        kv_blocks_extra=rng.choice((0, 0, 1, 2, 5, 20, 200)),
        encoder_items_extra=rng.choice((None, 0, 0, 1, 3, 50)),
        pictures=pictures,
        driver=driver,
        callers=callers,
        quick=quick,
        adapters=adapters,
        triton=triton,
    )


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class _Drawer:
    """Draws requests: shared system prefixes, repeated pictures (recently used ones more often),
    multi-turn extensions of earlier requests, salts, uuids, and about 5% bad requests."""

    def __init__(
        self, rng: random.Random, family: str, pictures: list[Picture], systems: list[str], quick: bool, repeat_rate: float,
        num_adapters: int = 0, system_rate: float = 0.7,
    ) -> None:
        self.rng, self.family, self.pictures, self.systems, self.quick = rng, family, pictures, systems, quick
        self.num_adapters = num_adapters
        self.system_rate = system_rate  # how often a new conversation starts with one of the system texts
        self.repeat_rate = repeat_rate  # how often a picture drawn is one of the last few requests' pictures
        self.made: list[RequestSpec] = []  # valid driver requests so far (multi-turn bases)
        # videos are drawn apart from the workload's own draws, so a seed's workload stays what it was
        self.video_rng = random.Random(f"{family}-{len(pictures)}-{len(systems)}-videos")
        self.hostile_rng = random.Random(f"{family}-{len(pictures)}-{len(systems)}-hostile")  # likewise

    def request(self, driver: bool = False, earlier: list[RequestSpec] = ()) -> RequestSpec:
        rng = self.rng
        bases = [spec for spec in (self.made if driver else earlier) if spec.clip is None]
        num_images = rng.choice((0, 1, 1, 1, 2, 2, 3))
        picked = [self._picture() for _ in range(num_images)]
        question = _words(rng, rng.randint(1, 10))
        base = None
        if bases and rng.random() < 0.3:
            base = rng.choice(bases)
            prompt = continue_chat(self.family, base.prompt, _words(rng, rng.randint(1, 6)), question, num_images)
            picked = base.pictures + picked
            if len(picked) > MAX_IMAGES:
                picked, prompt = base.pictures, continue_chat(self.family, base.prompt, "yes", question, 0)
        else:
            system = rng.choice(self.systems) if rng.random() < self.system_rate else None
            prompt = turn(self.family, question, num_images, system)
        spec = RequestSpec(
            prompt=prompt,
            pictures=picked,
            forms=[rng.choice(FORMS) for _ in picked],
            use_uuids=rng.random() < 0.5,
            salt=rng.choice((None, None, None, "tenant-a", "tenant-b")),
            max_tokens=rng.randint(1, 6 if self.quick else 10),
        )
        if self.num_adapters:  # an extension mostly keeps its conversation's adapter (and so its prefix blocks)
            if base is not None and rng.random() < 0.8:
                spec.lora = base.lora
            elif rng.random() < 0.7:
                spec.lora = rng.randrange(self.num_adapters)
        spec.prompt_form = rng.choice(PROMPT_FORMS)
        if picked and spec.prompt_form in REFUSED_TOKEN_PROMPTS.get(self.family, ()):
            spec.prompt_form = "dict"
        if self.family not in NO_VIDEO and base is None and self.video_rng.random() < 0.2:
            spec.clip = self.video_rng.randrange(len(CLIPS))
            head, user, rest = spec.prompt.rpartition("<|im_start|>user\n")
            spec.prompt = head + user + VIDEO_MARKER + rest
            spec.prompt_form = self.video_rng.choice(("text", "dict"))  # videos need a text prompt
        if rng.random() < 0.05:
            spec.prompt_form, spec.clip = "text", None  # the defects are written on the text and its images
            spec.prompt = spec.prompt.replace(VIDEO_MARKER, "")
            self._spoil(spec)
        elif driver:
            if rng.random() < 0.15:
                spec.abort_after_steps = rng.randint(0, 12)
            self.made.append(spec)
        return spec

    def _picture(self) -> int:
        """Recently drawn pictures come back more often: the workload repeats images."""
        rng = self.rng
        if self.made and rng.random() < self.repeat_rate:
            recent = [i for spec in self.made[-3:] for i in spec.pictures]
            if recent:
                return rng.choice(recent)
        return rng.randrange(len(self.pictures))

    def _spoil(self, spec: RequestSpec) -> None:
        defect = self.rng.choice(sorted(set(DEFECTS) - {"hostile_video"}))
        if self.family not in NO_VIDEO and self.hostile_rng.random() < 0.4:
            spec.defect, spec.hostile = "hostile_video", self.hostile_rng.choice(HOSTILE_PAYLOADS)
            spec.clip = 0
            head, user, rest = spec.prompt.rpartition("<|im_start|>user\n")
            spec.prompt = head + user + VIDEO_MARKER + rest
            return
        if defect in ("corrupt", "count", "image_type") and not spec.pictures:
            defect = "too_long"
        if defect == "unknown_adapter" and not self.num_adapters:
            defect = "too_long"
        spec.defect = defect
        if defect in ("corrupt", "image_type"):
            spec.use_uuids = False  # a known uuid stands for its picture, which is then never read
        if defect == "too_many":
            spec.prompt = turn(self.family, "too many", MAX_IMAGES + 1)
            spec.pictures = [self._picture() for _ in range(MAX_IMAGES + 1)]
            spec.forms = ["object"] * len(spec.pictures)
        elif defect == "too_long":
            spec.prompt = turn(self.family, _words(self.rng, 2 * MAX_MODEL_LEN), 0)
            spec.pictures, spec.forms = [], []
        elif defect == "uuids":
            spec.use_uuids = True  # fuzzer.py gives one uuid more than there are images
