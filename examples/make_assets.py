"""Generate the small tokenizer and text corpus used by the CPU examples.

Writes (deterministically, no downloads):

* ``titan_primus/integrations/torchtitan/common/assets/corpus/data.jsonl``: JSON lines, one ``{"text": ...}``
  document per line -- the format TorchTitan's ``c4_test`` dataset reads
  (``load_dataset(<dir>, split="train")``). Pass the folder with
  ``--dataloader.dataset_path titan_primus/integrations/torchtitan/common/assets/corpus``.
* ``titan_primus/integrations/torchtitan/common/assets/tokenizer/{tokenizer.json,tokenizer_config.json}``: a
  ByteLevel BPE tokenizer with 2000 tokens (the llama3 / deepseek_v3 / qwen3
  debug models have vocab_size 2048), trained on that corpus. Its
  ``tokenizer_config.json`` names the BOS/EOS tokens the way TorchTitan's
  ``HuggingFaceTokenizer`` expects. Pass the folder with
  ``--hf_assets_path titan_primus/integrations/torchtitan/common/assets/tokenizer``.

Run from anywhere:  python examples/make_assets.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import decoders, models, pre_tokenizers, processors, Tokenizer, trainers

ASSETS = Path(__file__).resolve().parent.parent / "titan_primus" / "integrations" / "torchtitan" / "common" / "assets"
SEED = 1234
NUM_DOCS = 700
VOCAB_SIZE = 2000
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"

NAMES = """Ada Ben Clara David Elena Farid Grace Hugo Iris Jonas Kira Liam Maya Nora
Omar Priya Quinn Rosa Samir Tara Umar Vera Wen Xavier Yara Zane Amelia Bruno
Celeste Dmitri Esther Felix Gideon Harriet Ingrid Jasper Leopold Matilda Nikolai
Ophelia Penelope Reginald Sebastian Theodora Ulrich Valentina Winifred""".split()
PLACES = """the harbor|the old mill|the market|the library|the valley|the station|
the river bank|the north field|the workshop|the lighthouse|the village square|
the garden|the bakery|the bridge|the forest path|the school|the museum|the farm|
the hill|the quiet street""".replace("\n", "").split("|")
NOUNS = """apple basket bell boat book bottle bread bridge candle cart chair cloud
coat coin door dog drum engine feather fence field fire flag flower garden gate
glass hammer hat horse house island kettle key ladder lamp letter map market
mirror needle net orchard paper pencil piano picture plate pocket rope sail seed
ship shoe signal stone storm story string table tent thread ticket tower train
tree umbrella violin wagon wall watch wheel window wire acorn anchor anvil
apron arrow badge balloon banner barrel beacon blanket bucket button cabin
camera canal canvas carpet castle cellar chimney clock compass cottage crate
curtain cushion desk diary envelope fountain furnace glove granary harvest helmet
hinge jacket journal kitchen lantern ledger locket meadow medal mountain notebook
ocean paddle parcel pebble pillow pipe puzzle quilt radio ribbon saddle scarf
shelf shovel sledge spoon stable statue telescope thimble tunnel valley vessel
whistle windmill workbench""".split()
ADJS = """ancient bright broken busy calm careful cheerful clever cold curious dark
distant dusty early empty famous gentle golden green heavy hidden honest huge
kind late little lonely loud narrow new noisy old pale patient polished proud
quiet rapid rough round rusty silent simple small smooth soft steady strange
strong sudden sweet tall tiny warm wet wide wild wooden young amber bitter bold
brave brittle crimson crooked delicate eager faded fragile frozen generous glossy
graceful hollow humble icy jagged lively marble mellow misty modest muddy nimble
ordinary peaceful plain purple sandy scarlet shallow shiny silver sleepy slender
sturdy tangled tender thorny velvet violet weary windy wiry yellow""".split()
VERBS_PAST = """carried cleaned closed counted crossed discovered dropped fixed
followed found gathered guarded heard helped lifted measured mended moved noticed
opened painted pulled pushed repaired returned saved shared showed studied
touched traded watched weighed wrapped borrowed
collected decorated delivered examined explained finished hammered invented
polished prepared recorded rescued scrubbed sketched sorted stitched tested
unpacked visited whispered""".split()
VERBS_BASE = """build carry clean count cross fix follow gather guard help lift
measure mend move open paint pull push repair return save share show study trade
watch weigh wrap""".split()
ADVS = """quickly slowly carefully quietly happily gladly softly suddenly calmly
eagerly patiently boldly gently proudly rarely""".split()
TIMES = """In the morning|At noon|Before dawn|Late in the evening|On Monday|
After the storm|During the festival|Every spring|Once a year|Later that week|
By midnight|At first light""".replace("\n", "").split("|")
CONNECT = ["Then", "Afterwards", "Meanwhile", "Still", "Even so", "Soon", "Because of this", "Later"]
TOPICS = """weather trade music farming sailing cooking building travel history
science gardening teaching weaving mapping astronomy
carpentry chemistry geography mathematics medicine navigation painting poetry
pottery sculpture botany architecture photography philosophy engineering""".split()


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def sentence(r: random.Random) -> str:
    n, m = r.choice(NAMES), r.choice(NAMES)
    noun, noun2 = r.choice(NOUNS), r.choice(NOUNS)
    adj, adj2 = r.choice(ADJS), r.choice(ADJS)
    place = r.choice(PLACES)
    templates = [
        lambda: f"{r.choice(TIMES)}, {n} {r.choice(VERBS_PAST)} {_a(adj)} {noun} near {place}.",
        lambda: f"{n} {r.choice(ADVS)} {r.choice(VERBS_PAST)} the {noun} and gave it to {m}.",
        lambda: (
            f"The {adj} {noun} was {r.choice(['next to', 'behind', 'under', 'beside', 'above'])} the {adj2} {noun2}."
        ),
        lambda: f'"Can you {r.choice(VERBS_BASE)} the {noun}?" asked {n}.',
        lambda: (
            f'"I will {r.choice(VERBS_BASE)} it {r.choice(["tomorrow", "today", "soon", "after lunch", "tonight"])}," said {m}.'
        ),
        lambda: f"{r.choice(CONNECT)}, {n} and {m} walked to {place} with {r.randint(2, 19)} {noun}s.",
        lambda: f"Nobody knew why the {noun} at {place} looked so {adj}.",
        lambda: (
            f"It cost {r.randint(2, 90)} coins, which {n} thought was {r.choice(['fair', 'too much', 'a bargain', 'strange'])}."
        ),
        lambda: f"{n} {r.choice(ADVS)} explained that {r.choice(TOPICS)} requires {adj} {noun}s and {adj2} {noun2}s.",
        lambda: f"{n} wrote a note about {r.choice(TOPICS)} and left it on the {adj} {noun}.",
        lambda: f"There were {r.randint(3, 40)} {adj} {noun}s in {place}, and {n} counted every one.",
        lambda: f"If the {noun} is {adj}, then the {noun2} must be {adj2}.",
        lambda: f"{m} liked {r.choice(TOPICS)} more than {r.choice(TOPICS)}.",
    ]
    return r.choice(templates)()


def document(r: random.Random, idx: int) -> str:
    title = f"{r.choice(ADJS).capitalize()} {r.choice(NOUNS)}s of {r.choice(PLACES)[4:].title()}"
    paras = []
    for _ in range(r.randint(1, 4)):
        paras.append(" ".join(sentence(r) for _ in range(r.randint(2, 6))))
    return f"{title} (part {idx % 7 + 1})\n\n" + "\n\n".join(paras)


def make_corpus() -> list[str]:
    r = random.Random(SEED)
    docs = [document(r, i) for i in range(NUM_DOCS)]
    out = ASSETS / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "data.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return docs


def make_tokenizer(docs: list[str]) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    out = ASSETS / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in (BOS, EOS, PAD)
    }
    config = {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "clean_up_tokenization_spaces": True,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    assert tok.get_vocab_size() <= 2048, tok.get_vocab_size()


def main() -> None:
    docs = make_corpus()
    make_tokenizer(docs)
    for p in sorted(ASSETS.rglob("*")):
        if p.is_file():
            print(f"{p.relative_to(ASSETS.parent.parent)}  {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
