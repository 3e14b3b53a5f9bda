"""Build a tiny Llama model, its tokenizer and two LoRA adapters, offline and deterministically.

    python scripts/build_tiny_model.py OUT_DIR [--force] [--base-model-ref REF]

Run it with the vLLM virtual environment's interpreter (it needs torch, transformers, tokenizers
and safetensors; no Django). It writes:

    OUT_DIR/base/                        a 2-layer Llama (hidden 256, 4 heads, 2 KV heads,
                                         head_dim 64, vocab 4096, bf16, random weights) with a
                                         byte-level BPE tokenizer and a chat template
    OUT_DIR/adapters/demo-tiny-pirate/   LoRA adapter (r 8, alpha 16, q_proj and v_proj)
    OUT_DIR/adapters/demo-tiny-formal/   LoRA adapter, another seed
    OUT_DIR/manifest.json                name, recipe hash and sha256 of every file

The same OUT_DIR, the same script and the same library versions give the same bytes every run:
fixed seeds, an embedded corpus (plus sentences generated from it with a seeded RNG), sorted JSON
keys. If OUT_DIR/manifest.json already describes what this run would build (same recipe hash, and
every listed file present with its sha256), the script exits at once without building: tests can
call it every run. `--force` rebuilds regardless. Concurrent runs on one OUT_DIR serialise on
OUT_DIR/.build.lock; a build goes to a scratch directory first and the manifest is written last.

`base_model_name_or_path` in each adapter_config.json is the absolute path of OUT_DIR/base unless
`--base-model-ref` says otherwise (vLLM's filesystem LoRA resolver, VLLM_LORA_RESOLVER_CACHE_DIR,
only resolves adapters whose base_model_name_or_path equals the served model name, e.g.
`--base-model-ref demo-tiny`). It is the only thing that depends on OUT_DIR.

The model's text is noise; its token counts, timings, metrics and protocol under vLLM are real.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

NAME = "demo-tiny"
ADAPTERS = {"demo-tiny-pirate": 1001, "demo-tiny-formal": 2002}
MODEL_SEED = 1234
CORPUS_SEED = 42
VOCAB_SIZE = 4096
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "vocab_size": VOCAB_SIZE,
}
LORA_R = 8
LORA_ALPHA = 16
LORA_TARGETS = ["q_proj", "v_proj"]
MANIFEST_VERSION = 1

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, *ROLE_TOKENS]  # ids 0..6, in this order

# Llama-style simple template: "<s><|user|>\nHi</s>\n<|assistant|>\n". Content is a string
# (vLLM flattens text parts into one string for templates that do not loop over parts).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] | trim + eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

PROSE = """\
The morning train left the station a few minutes late, and the passengers settled into their
seats with coffee, newspapers and the quiet patience of people who make the same journey every
day. Outside the window the fields were still grey with frost, and a thin line of smoke rose from
a farmhouse chimney beyond the river.

In the small town where she grew up, the library was the only building that stayed open after
dark. She spent most evenings there, reading about distant countries, old wars, the history of
mathematics and the lives of the people who had built the bridges, railways and harbours that
connected the world.

Engineers who operate large computer systems learn to measure everything. They watch latency,
throughput, error rates and memory usage, and they set alarms that wake them in the night when a
service begins to fail. A good dashboard tells a clear story: what changed, when it changed, and
which customers were affected.

The recipe is simple. Melt the butter in a heavy pan, add the onions and cook them slowly until
they are soft and golden. Stir in the flour, then the warm milk, a little at a time, so that the
sauce stays smooth. Season it with salt, pepper and a pinch of nutmeg before you pour it over the
vegetables.

Scientists have studied the migration of birds for more than a century. Some species fly
thousands of kilometres each autumn, crossing mountains, deserts and open sea, and return in the
spring to the very same valley. They appear to navigate by the sun, the stars and the magnetic
field of the earth.

When the committee met again in November, the chairman asked each member to present a short
report. The treasurer explained that the budget was balanced, although the cost of heating the
hall had risen sharply. The secretary read the letters that had arrived since the last meeting,
and the members voted to repair the roof before the winter.

A language model reads a sequence of tokens and predicts the next one. During training it sees
billions of examples, and its parameters are adjusted so that the correct token becomes more
likely. At inference time the model generates text one token at a time, and a server schedules
many requests together so that the hardware is used efficiently.

The children ran down to the beach as soon as the car stopped. The tide was out, the sand was
wet and firm, and there were small pools among the rocks where crabs and tiny fish hid from the
gulls. Their father carried the basket, the blanket and the umbrella, and complained cheerfully
about all of them.

Good software is written for the people who will read it later. Names should say what a thing
is, functions should do one job, and every error should explain what went wrong and what the user
can do about it. Tests are not a burden; they are the record of what the program promises.

The old captain said the sea had taught him two things: respect the weather, and never trust a
calm morning. He had sailed through storms off the northern coast, waited for weeks in foreign
ports for cargo that never came, and still he woke every day before dawn to look at the sky.

Prices in the market changed with the seasons. In summer there were tomatoes, peaches, beans and
sweet corn, and in winter there were cabbages, potatoes, apples and onions that had been stored
in cold cellars. The farmers knew their customers by name and often added an extra pear to the
bag.

The museum opened a new exhibition about the history of flight. Visitors could walk beneath a
wooden glider from the nineteenth century, sit in the cockpit of an early passenger aircraft,
and watch a film about the engineers who designed the first jet engines during the war.

Please remember that the office will be closed on Friday for maintenance. All requests submitted
after noon on Thursday will be processed on Monday morning. If you need urgent help during the
weekend, call the number printed on the back of your card, and a member of our team will answer.

Mountains shape the weather of the regions around them. Moist air rises along the slopes, cools
and falls as rain or snow, while the valleys on the other side remain dry. This is why some
towns receive a great deal of rain every year and others, only a short distance away, very little.

He opened the letter slowly, as if the words inside might change if he waited long enough. It was
from his brother, who had moved abroad twenty years earlier and had not written since. The letter
was short: he was coming home in the spring, and he hoped there would be room for him at the table.
"""


def words(text: str) -> list[str]:
    return text.split()


NOUNS = words(
    """
time year people way day man woman child world life hand part place case week company system
program question work government number night point home water room mother area money story fact
month lot right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war history party result
change morning reason research girl guy moment air teacher force education foot boy age policy
music market sense nation plan college interest death experience effect class control care field
development role effort rate heart drug show leader light voice wife police mind price report
decision son view relationship town road arm difference value building action model season society
tax director position player record paper space ground form event official matter center couple
site project activity star table need court oil situation cost industry figure street image phone
data picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair window
evidence population truth song energy trade garden river bridge island forest mountain village
kitchen station engine server request token model memory cache network signal message answer
letter bottle window pencil blanket harbour railway library sugar butter flour onion potato apple
weather storm cloud winter summer autumn spring coast valley desert ocean planet engineer farmer
captain sailor student doctor lawyer artist writer singer driver pilot nurse chef baker
airport hospital university factory theatre restaurant hotel church castle palace museum prison
journey holiday festival concert lecture meeting interview election contract agreement argument
mistake problem solution method process question discussion conversation opinion feeling thought
animal horse rabbit sheep chicken eagle whale insect flower grass stone metal glass plastic cotton
breakfast dinner lunch bread cheese coffee orange lemon cherry pepper carrot salad soup chocolate
camera battery keyboard screen printer software hardware database browser password account
customer manager employee neighbour stranger visitor audience crowd soldier officer prisoner
mirror ladder bucket basket pocket jacket shirt trousers shoes umbrella blanket pillow curtain
temperature pressure distance weight height length speed direction surface corner edge middle
"""
)

VERBS = words(
    """
ask build call carry change choose close come cook cross decide describe design discover drive
explain fall feel find finish follow give grow help hold improve keep know learn leave listen look
make measure meet move need open order pay play plan prepare present produce promise provide read
reach receive remember repair report return run save say see sell send serve show sing sit speak
spend stand start stay stop study take talk teach tell think travel try turn understand use visit
wait walk want watch win work write answer arrive bring climb count dance deliver enjoy fix gather
hope imagine invite jump kick laugh lift paint pull push rain reply rest sail search shout smile
solve sort test train trust wash wonder
accept admire allow announce appear argue attack avoid borrow breathe celebrate collect compare
complain connect consider continue copy cover damage deserve destroy develop disappear divide
encourage escape examine exist expect explore express finish forget forgive guess hurry ignore
include increase inform introduce invent manage mention notice obtain offer organise perform
persuade practise prefer pretend prevent protect publish recognise recommend reduce refuse relax
replace request rescue respect review satisfy separate settle shake signal suggest supply
surprise survive switch translate treat vanish warn whisper worry
"""
)

IRREGULAR_PAST = dict(
    pair.split(":")
    for pair in words(
        """
build:built choose:chose come:came drive:drove fall:fell feel:felt find:found give:gave
grow:grew hold:held keep:kept know:knew leave:left make:made meet:met pay:paid read:read
run:ran say:said see:saw sell:sold send:sent sing:sang sit:sat speak:spoke spend:spent
stand:stood take:took teach:taught tell:told think:thought understand:understood win:won
write:wrote bring:brought forget:forgot forgive:forgave shake:shook stop:stopped plan:planned
"""
    )
)
DOUBLE_FINAL = {"run", "sit", "win", "stop", "plan", "forget"}

ADJECTIVES = words(
    """
other new good high old great big small large national young different black long little
important political bad white real best right social only public sure low early able human local
late hard major better economic strong possible whole free military true federal international
full special easy clear recent certain personal open red difficult available likely short single
medical current wrong private past foreign fine common poor natural significant similar hot dead
central happy serious ready simple left physical general environmental financial blue democratic
dark various entire close legal religious cold final main green nice huge popular traditional
cultural quiet gentle bright heavy warm careful quick slow busy empty narrow ancient modern
famous strange wooden golden silver frozen rapid steady patient honest curious
beautiful wonderful terrible excellent ordinary unusual comfortable dangerous expensive cheap
delicious hungry thirsty tired angry nervous proud lonely brave clever polite rude friendly
enormous tiny narrow shallow smooth rough soft sharp bitter sweet fresh rotten broken perfect
"""
)

ADVERBS = words(
    """
quickly slowly carefully quietly suddenly finally usually often always never sometimes really
almost nearly clearly simply certainly probably recently early later together again already
"""
)

PLACES = words(
    """
London Paris Berlin Madrid Rome Vienna Lisbon Dublin Oslo Prague Warsaw Athens Cairo Tokyo Delhi
Sydney Toronto Chicago Boston Denver Seattle Austin Geneva Zurich Munich Milan Naples Porto
"""
)

PEOPLE = words(
    """
Alice Bob Carol David Emma Frank Grace Henry Isabel James Karen Louis Maria Nathan Olivia Peter
Rachel Samuel Thomas Ursula Victor William Sophie Daniel Laura Michael Anna George Helen Oscar
"""
)

DETERMINERS = ["the", "a", "this", "that", "every", "one", "her", "his", "our", "their", "my"]
PREPOSITIONS = words(
    """
in on at near under over behind beside across through into from with without after before during
around between
"""
)
CONJUNCTIONS = ["and", "but", "because", "while", "although", "so", "when", "until", "since"]


def plural(noun: str) -> str:
    if noun in {"man", "woman"}:
        return noun[:-2] + "en"
    if noun == "child":
        return "children"
    if noun == "person":
        return "people"
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def past(verb: str) -> str:
    if verb in IRREGULAR_PAST:
        return IRREGULAR_PAST[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def gerund(verb: str) -> str:
    if verb in DOUBLE_FINAL:
        return verb + verb[-1] + "ing"
    if verb.endswith("e") and verb not in {"see"}:
        return verb[:-1] + "ing"
    return verb + "ing"


def third(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def sentence(rng: random.Random) -> str:
    def np() -> str:
        noun = rng.choice(NOUNS)
        if rng.random() < 0.3:
            return f"{rng.choice(ADJECTIVES)} {plural(noun)}"
        adj = f"{rng.choice(ADJECTIVES)} " if rng.random() < 0.5 else ""
        return f"{rng.choice(DETERMINERS)} {adj}{noun}"

    def clause() -> str:
        verb = rng.choice(VERBS)
        form = rng.randrange(6)
        subj = rng.choice(PEOPLE) if rng.random() < 0.3 else np()
        if form == 0:
            vp = past(verb)
        elif form == 1:
            vp = third(verb)
        elif form == 2:
            vp = f"was {gerund(verb)}"
        elif form == 3:
            vp = f"will {verb}"
        elif form == 4:
            vp = f"has {past(verb)}"
        else:
            vp = f"{rng.choice(ADVERBS)} {past(verb)}"
        tail = f" {np()}" if rng.random() < 0.7 else ""
        if rng.random() < 0.6:
            tail += f" {rng.choice(PREPOSITIONS)} {rng.choice([np(), rng.choice(PLACES)])}"
        if rng.random() < 0.15:
            number = rng.choice(
                [
                    str(rng.randrange(2, 100)),
                    str(rng.randrange(100, 10000)),
                    str(rng.randrange(1900, 2030)),
                    f"{rng.randrange(0, 100)}.{rng.randrange(0, 10)}",
                ]
            )
            tail += f" {rng.choice(['in', 'for', 'after', 'about'])} {number} {plural(rng.choice(NOUNS))}"
        return f"{subj} {vp}{tail}"

    text = clause()
    if rng.random() < 0.4:
        text += f"{',' if rng.random() < 0.5 else ''} {rng.choice(CONJUNCTIONS)} {clause()}"
    text = text[0].upper() + text[1:]
    end = rng.choices([".", "?", "!"], weights=[85, 10, 5])[0]
    if rng.random() < 0.1:
        text = f'"{text}{end}" said {rng.choice(PEOPLE)}.'
        return text
    return text + end


def corpus() -> list[str]:
    rng = random.Random(CORPUS_SEED)
    paragraphs = [p.replace("\n", " ") for p in PROSE.split("\n\n") if p.strip()]
    texts = paragraphs * 20
    for _ in range(6000):
        texts.append(" ".join(sentence(rng) for _ in range(rng.randrange(2, 7))))
    return texts


class BaseInfo(TypedDict):
    """What `build_base` tells the manifest about the base model."""

    parameters: int
    tokenizer_vocab: int
    token_ids: dict[str, int]


class Manifest(TypedDict):
    """OUT_DIR/manifest.json."""

    adapters: list[str]
    base_model_ref: str
    files: dict[str, str]  # path relative to OUT_DIR -> sha256
    manifest_version: int
    model: dict[str, object]  # MODEL, the dtype and the BaseInfo
    name: str
    recipe: str
    versions: dict[str, str | None]  # distribution -> version (None: not installed)


def build_tokenizer(out: Path) -> tuple[PreTrainedTokenizerFast, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=MODEL["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out), save_jinja_files=False)
    # transformers 5 writes its own class name (TokenizersBackend); the portable name loads the
    # same tokenizer there and in transformers 4.x as well.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_json(config_path, config)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert [ids[t] for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS))), ids
    return fast, tok.get_vocab_size()


def build_base(out: Path) -> BaseInfo:
    import torch
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    transformers.utils.logging.disable_progress_bar()
    out.mkdir(parents=True)
    fast, tok_vocab = build_tokenizer(out)
    ids = {t: fast.convert_tokens_to_ids(t) for t in (BOS, EOS, PAD)}

    torch.manual_seed(MODEL_SEED)
    config = LlamaConfig(
        **MODEL,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    with torch.no_grad():
        model = LlamaForCausalLM(config)
        model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD]
    )
    model.save_pretrained(str(out))
    for path in out.iterdir():
        path.chmod(0o644)
    params = sum(p.numel() for p in model.parameters())
    return {"parameters": params, "tokenizer_vocab": tok_vocab, "token_ids": ids}


def build_adapter(out: Path, seed: int, base_ref: str) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    hidden = MODEL["hidden_size"]
    outs = {
        "q_proj": MODEL["num_attention_heads"] * MODEL["head_dim"],
        "v_proj": MODEL["num_key_value_heads"] * MODEL["head_dim"],
    }
    tensors = {}
    for layer in range(MODEL["num_hidden_layers"]):
        for module in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(LORA_R, hidden, generator=gen) / hidden**0.5
            b = torch.randn(outs[module], LORA_R, generator=gen) * 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "base_model_name_or_path": base_ref,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": LORA_R,
        "target_modules": LORA_TARGETS,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
    write_json(out / "adapter_config.json", config)


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for dist in ("torch", "transformers", "tokenizers", "safetensors"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found


def recipe_hash(base_ref: str) -> str:
    """What the build depends on: this script's source, the base reference, library versions."""
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(json.dumps({"base_ref": base_ref, "versions": versions()}, sort_keys=True).encode())
    return h.hexdigest()


def manifest_matches(out_dir: Path, recipe: str) -> bool:
    try:
        manifest = json.loads((out_dir / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if manifest.get("recipe") != recipe or not manifest.get("files"):
        return False
    for rel, digest in manifest["files"].items():
        path = out_dir / rel
        if not path.is_file() or sha256(path) != digest:
            return False
    return True


def build(out_dir: Path, base_ref: str, recipe: str) -> Manifest:
    """Build everything into a scratch directory beside OUT_DIR, then move it into place."""
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir))
    try:
        info = build_base(scratch / "base")
        for name, seed in ADAPTERS.items():
            build_adapter(scratch / "adapters" / name, seed, base_ref)
        files = {
            str(p.relative_to(scratch)): sha256(p)
            for p in sorted(scratch.rglob("*"))
            if p.is_file()
        }
        manifest: Manifest = {
            "adapters": sorted(ADAPTERS),
            "base_model_ref": base_ref,
            "files": files,
            "manifest_version": MANIFEST_VERSION,
            "model": {**MODEL, "dtype": "bfloat16", **info},
            "name": NAME,
            "recipe": recipe,
            "versions": versions(),
        }
        (out_dir / "manifest.json").unlink(missing_ok=True)
        for part in ("base", "adapters"):
            shutil.rmtree(out_dir / part, ignore_errors=True)
            (scratch / part).rename(out_dir / part)
        write_json(out_dir / "manifest.json", manifest)  # last: a crash leaves no manifest
        return manifest
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument(
        "--base-model-ref",
        help="base_model_name_or_path for the adapters (default: absolute path of OUT_DIR/base)",
    )
    args = parser.parse_args(argv)
    out_dir = args.out_dir.resolve()
    base_ref = args.base_model_ref or str(out_dir / "base")
    started = time.monotonic()
    recipe = recipe_hash(base_ref)
    if not args.force and manifest_matches(out_dir, recipe):
        print(f"{out_dir}: up to date (manifest matches), nothing to do")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent callers: one builds, the others wait
        if not args.force and manifest_matches(out_dir, recipe):
            print(f"{out_dir}: up to date (built by a concurrent run), nothing to do")
            return 0
        manifest = build(out_dir, base_ref, recipe)
    m = manifest["model"]
    print(
        f"{out_dir}: built {NAME} ({m['parameters']:,} parameters, tokenizer vocab "
        f"{m['tokenizer_vocab']}), adapters {', '.join(manifest['adapters'])}, "
        f"{len(manifest['files'])} files in {time.monotonic() - started:.1f}s"
    )
    for rel, digest in manifest["files"].items():
        print(f"  {digest[:16]}  {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
