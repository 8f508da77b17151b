"""`make demo` until the gateway lands: stream a greedy generation through our paged runtime."""

from __future__ import annotations

import sys
import time

from specdec.model.chat import encode_chat
from specdec.model.runtime import build_runtime
from specdec.model.tokenizer_info import TokenizerInfo

PROMPT = "Explain speculative decoding in two sentences."


def main(max_new_tokens: int = 64) -> None:
    runtime = build_runtime("smollm2-135m", dtype="float32")
    tokenizer = runtime.loaded.tokenizer
    eos = set(TokenizerInfo.of(runtime.loaded.model, tokenizer).eos_token_ids)
    prompt = encode_chat(tokenizer, [{"role": "user", "content": PROMPT}])
    cache = runtime.forward.new_cache(token_budget=len(prompt) + max_new_tokens + 16)
    cache.blocks.allocate("demo")
    print(f"> {PROMPT}\n", flush=True)
    start = time.perf_counter()
    chunk, generated, shown = prompt, [], ""
    while len(generated) < max_new_tokens:
        token = int(runtime.forward.run(cache, [("demo", chunk)])[0].argmax())
        if token in eos:
            break
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # hold back an incomplete UTF-8 character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
        chunk = [token]
    elapsed = time.perf_counter() - start
    print(f"\n\n[{len(generated)} tokens in {elapsed:.1f} s, {len(generated) / elapsed:.1f} tok/s]")


if __name__ == "__main__":
    main()
