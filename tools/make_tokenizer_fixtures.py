"""Writes tests/fixtures/tokenizer/{smollm2,qwen25coder}.json: llama.cpp's own token ids for many strings.

The reference is llama.cpp's ``llama_tokenize`` (the tokenizer llama-cli uses for GGUF files), called
by a 40-line C++ program (``REFTOK_CPP`` below) linked against llama.cpp's ``llama`` library only,
loading each GGUF with ``vocab_only``. llama.cpp's sources come from the llama-cpp-python sdist:

    pip download --no-deps --no-binary :all: llama-cpp-python -d /work/dl/llamacpp
    tar xzf /work/dl/llamacpp/llama_cpp_python-*.tar.gz -C /work/dl/llamacpp
    python tools/make_tokenizer_fixtures.py \
        --llama-cpp /work/dl/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp

The first run configures and builds the program with cmake (-DGGML_NATIVE=OFF, -O1, -j2; about
10 minutes on 2 cores) under --build-dir; later runs reuse the binary. Not needed by the tests.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "tests" / "fixtures" / "tokenizer"
MODELS = {
    "smollm2": Path("/work/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "qwen25coder": Path("/work/models/qwen2.5-coder-0.5b-instruct.gguf"),
}

REFTOK_CPP = r"""
// Reference tokenizer: llama.cpp's own llama_tokenize over hex-encoded lines.
// usage: reftok MODEL.gguf INPUT.hex ADD_SPECIAL(0/1) PARSE_SPECIAL(0/1)
#include "llama.h"
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

static void quiet_log(enum ggml_log_level, const char *, void *) {}

static std::string unhex(const std::string & h) {
    std::string out;
    for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back((char) std::stoi(h.substr(i, 2), nullptr, 16));
    return out;
}

int main(int argc, char ** argv) {
    if (argc != 5) { fprintf(stderr, "usage: reftok MODEL INPUT ADD_SPECIAL PARSE_SPECIAL\n"); return 2; }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const bool add_special = argv[3][0] == '1';
    const bool parse_special = argv[4][0] == '1';
    const int n_vocab = llama_vocab_n_tokens(vocab);
    printf("n_tokens %d\nbos %d\neos %d\neot %d\nadd_bos %d\n", n_vocab, llama_vocab_bos(vocab),
           llama_vocab_eos(vocab), llama_vocab_eot(vocab), (int) llama_vocab_get_add_bos(vocab));
    printf("eog");
    for (int t = 0; t < n_vocab; ++t) if (llama_vocab_is_eog(vocab, t)) printf(" %d", t);
    printf("\n");
    std::ifstream in(argv[2]);
    std::string line;
    while (std::getline(in, line)) {
        const std::string text = unhex(line);
        int n = -llama_tokenize(vocab, text.data(), (int) text.size(), nullptr, 0, add_special, parse_special);
        std::vector<llama_token> ids(n > 0 ? n : 1);
        n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), add_special, parse_special);
        printf("ids");
        for (int i = 0; i < n; ++i) printf(" %d", ids[i]);
        printf("\n");
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
"""

REFTOK_CMAKE = r"""
cmake_minimum_required(VERSION 3.14)
project(reftok CXX C)
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_TESTS OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_TOOLS OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_EXAMPLES OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_SERVER OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_APP OFF CACHE BOOL "" FORCE)
set(LLAMA_OPENSSL OFF CACHE BOOL "" FORCE)
set(GGML_NATIVE OFF CACHE BOOL "" FORCE)
set(GGML_OPENMP OFF CACHE BOOL "" FORCE)
set(BUILD_SHARED_LIBS OFF CACHE BOOL "" FORCE)
add_subdirectory(${LLAMA_CPP_DIR} llama.cpp)
add_executable(reftok reftok.cpp)
target_link_libraries(reftok PRIVATE llama)
target_compile_features(reftok PRIVATE cxx_std_17)
"""

# Hand-picked strings: each family of pre-tokenizer rule and a few known llama.cpp quirks.
FIXED_STRINGS = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "a", "Hello world", " Hello world",
    "Hello  world", "Hello   world  ", "hello\tworld\t\tend", "line one\nline two\n\n\nline three",
    "trailing spaces   ", "   leading spaces", "mixed \t \n \r\n whitespace",
    "0", "7", "42", "123", "1234", "12345", "3.14159", "1,000,000", "2024-05-17", "+1 (555) 010-9999",
    "x=1234567890123456789", "v1.2.3-rc4", "0xDEADBEEF", "1e-10", "½ ¾ ² ³ Ⅻ", "٣٤٥ ١٢", "１２３ ＡＢＣ",
    "I'm sure it's fine, isn't it? We're here, they've gone, you'll see, he'd know.",
    "IT'S LOUD, WE'RE HERE, YOU'LL SEE", "rock 'n' roll", "'s 't 're 've 'm 'll 'd", "''",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "fn main() {\n    let v: Vec<u8> = vec![1, 2, 3];\n    println!(\"{:?}\", v);\n}",
    "const f = async (x) => { await fetch(`/api/${x}`); };",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "<div class=\"a\">&nbsp;&lt;tag&gt;</div>", "{\"key\": [1, 2.5, null, true], \"s\": \"\\u00e9\"}",
    "if x != y && z == w || !q { return; }", "a->b::c<<d>>e", "....,,,;;;!!!???", "~!@#$%^&*()_+-={}[]|\\:;\"'<>,./?",
    "naïve café résumé façade Ångström", "Ça va? Größe Straße ß ÿ", "e\u0301 a\u0300 n\u0303 (combining)",
    "日本語のテキストです。", "中文字符测试，包括标点。", "한국어 텍스트 입니다", "ภาษาไทย", "हिन्दी भाषा",
    "Привет, мир! Ёлка", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "English עברית mixed العربية 123",
    "😀", "😀😃😄", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇮🇸🇯🇵🇺🇸", "❤️", "a😀b", " 😀 ", "✓ ✗ → ← ∑ ∞ ≠ ≤",
    "\u00a0non\u00a0breaking\u00a0", "ideographic\u3000space", "thin\u2009space", "zero\u200bwidth",
    "line\u2028sep", "next\u0085line", "soft\u00adhyphen", "bom\ufeffhere", "tab\x0bvt\x0cff", "nul\x00byte",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n", "text<|im_end|>text", "<|im_start|><|im_start|>",
    " <|im_start|> ", "<|im_start", "im_start|>", "<|IM_START|>", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "<|fim_prefix|>def f(<|fim_suffix|>):<|fim_middle|>", "<repo_name>kjarni<file_sep>a.py", "<filename>x.py",
    "The quick brown fox jumps over the lazy dog. " * 3,
]

# Character pools for seeded random strings: the categories llama.cpp's regexes tell apart.
POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " ", "  \t\n\r",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "'sStTrReEvVmMlLdD", "éèêëàâäôöûüçñßÅøæœ", "\u0301\u0308\u0327",
    "日本語中文字测试漢字", "ひらがなカタカナ", "한국어", "مرحبابالعالم", "שלוםעולם", "हिन्दी", "ภาษาไทย",
    "Привет", "😀👍🏽❤️🇮🇸\u200d\ufe0f", "½²³Ⅻ٣١２", "\u00a0\u3000\u2009\u200b\u2028\u0085\u00ad",
    "→∑∞≠≤©®™€£¥", "\x00\x01\x1b\x7f",
]


def random_strings(count: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        pools = rng.sample(POOLS, rng.randint(1, 4))
        out.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 24))))
    return out


def build_reftok(llama_cpp: Path, build_dir: Path) -> Path:
    binary = build_dir / "build" / "reftok"
    if binary.exists():
        return binary
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "reftok.cpp").write_text(REFTOK_CPP)
    (build_dir / "CMakeLists.txt").write_text(REFTOK_CMAKE)
    subprocess.run(["cmake", "-S", str(build_dir), "-B", str(build_dir / "build"), f"-DLLAMA_CPP_DIR={llama_cpp}",
                    "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_CXX_FLAGS_RELEASE=-O1", "-DCMAKE_C_FLAGS_RELEASE=-O1"],
                   check=True)
    subprocess.run(["cmake", "--build", str(build_dir / "build"), "--target", "reftok", "-j2"], check=True)
    return binary


def run_reftok(binary: Path, model: Path, texts: list[str], *, add_special: bool, parse_special: bool
               ) -> tuple[dict, list[list[int]]]:
    """llama.cpp's ids for each text, and the vocabulary facts it reports."""
    with tempfile.NamedTemporaryFile("w", suffix=".hex", delete=False) as f:
        f.write("".join(t.encode("utf-8").hex() + "\n" for t in texts))
        hex_path = f.name
    result = subprocess.run([str(binary), str(model), hex_path, "1" if add_special else "0",
                             "1" if parse_special else "0"], check=True, capture_output=True)
    Path(hex_path).unlink()
    facts: dict = {}
    ids: list[list[int]] = []
    for line in result.stdout.decode().splitlines():
        name, _, rest = line.partition(" ")
        values = [int(v) for v in rest.split()]
        if name == "ids":
            ids.append(values)
        elif name == "eog":
            facts["eog"] = values
        else:
            facts[name] = values[0]
    assert len(ids) == len(texts), (len(ids), len(texts))
    return facts, ids


def write_retagged_gguf(src: Path, dst: Path, pre: str, drop_add_bos: bool) -> None:
    """A tensor-less copy of src's metadata with tokenizer.ggml.pre set to ``pre``.

    This is how llama.cpp's rules for pre-tokenizers that no shipped model uses (gpt-2, llama-bpe)
    get reference ids: same vocabulary and merges, another split regex. ``drop_add_bos`` removes
    tokenizer.ggml.add_bos_token so the pre-tokenizer's own default applies.
    """
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if drop_add_bos and key == "tokenizer.ggml.add_bos_token":
            continue
        value = pre if key == "tokenizer.ggml.pre" else field.contents()
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def make_fixture(binary: Path, model: Path, source: str, n_random: int) -> dict:
    texts = FIXED_STRINGS + random_strings(n_random)
    facts, ids = run_reftok(binary, model, texts, add_special=False, parse_special=True)
    bos_texts = ["Hello", "", "<|im_start|>user\nHi<|im_end|>"]
    _, bos_ids = run_reftok(binary, model, bos_texts, add_special=True, parse_special=True)
    plain_texts = [t for t in FIXED_STRINGS if "<" in t]
    _, plain_ids = run_reftok(binary, model, plain_texts, add_special=False, parse_special=False)
    return {
        "source": source,
        "model": model.name,
        "vocab_size": facts["n_tokens"],
        "bos_token_id": facts["bos"] if facts["bos"] >= 0 else None,
        "eos_token_id": facts["eos"] if facts["eos"] >= 0 else None,
        "eot_token_id": facts["eot"] if facts["eot"] >= 0 else None,
        "add_bos": bool(facts["add_bos"]),
        "eog_token_ids": facts["eog"],
        "cases": [{"text": t, "ids": i} for t, i in zip(texts, ids)],
        "cases_add_special": [{"text": t, "ids": i} for t, i in zip(bos_texts, bos_ids)],
        "cases_no_parse_special": [{"text": t, "ids": i} for t, i in zip(plain_texts, plain_ids)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path,
                        default=Path("/work/dl/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp"))
    parser.add_argument("--build-dir", type=Path, default=Path("/work/dl/llamacpp/reftok"))
    parser.add_argument("--source", default="llama.cpp vendored in llama-cpp-python 0.3.36 (sdist), "
                        "llama_tokenize(add_special, parse_special) via tools/make_tokenizer_fixtures.py")
    parser.add_argument("--random", type=int, default=300, help="seeded random strings per model")
    for name, path in MODELS.items():
        parser.add_argument(f"--{name}", type=Path, default=path)
    args = parser.parse_args()
    binary = build_reftok(args.llama_cpp, args.build_dir)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        write_fixture(name, make_fixture(binary, getattr(args, name), args.source, args.random))
    # The same SmolLM2 vocabulary under other pre-tokenizers (the test rebuilds these files).
    for pre, drop_add_bos in RETAGGED:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"smollm2-{pre}.gguf"
            write_retagged_gguf(args.smollm2, path, pre, drop_add_bos)
            fixture = make_fixture(binary, path, args.source, args.random // 8)
        fixture.update(derived_from=args.smollm2.name, pre=pre, drop_add_bos_token=drop_add_bos)
        write_fixture(f"smollm2-pre-{pre}", fixture)
    return 0


# (tokenizer.ggml.pre, drop tokenizer.ggml.add_bos_token) for write_retagged_gguf.
RETAGGED = [("gpt-2", False), ("llama-bpe", True), ("qwen2", False)]


def write_fixture(name: str, fixture: dict) -> None:
    out = OUT_DIR / f"{name}.json"
    # One case per line: diffs of regenerated fixtures stay readable.
    lines = json.dumps(fixture, ensure_ascii=True, separators=(",", ":"))
    lines = lines.replace(',{"text"', ',\n{"text"')
    out.write_text(lines + "\n")
    print(f"{out}: {len(fixture['cases'])} cases, {out.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    sys.exit(main())
