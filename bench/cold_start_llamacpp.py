"""The llama-cpp-python side of the cold-start comparison: load the GGUF, answer one chat request, exit.

Run with the peers' interpreter, from process start (as `tandem generate --chat --max-new-tokens 8`):

    bench/peers/venv/bin/python bench/cold_start_llamacpp.py models/SmolLM2-135M-Instruct.Q4_1.gguf Hi 8
"""
import sys

from llama_cpp import Llama

model_path, prompt, max_new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = Llama(model_path=model_path, n_ctx=2048, n_threads=2, verbose=False)
out = llm.create_chat_completion(messages=[{"role": "user", "content": prompt}], max_tokens=max_new_tokens,
                                 temperature=0.0)
print(out["choices"][0]["message"]["content"])
