"""Generate a few tokens with plain transformers from an exported model: proof that the export is a normal
Hugging Face model.

  python scripts/generate.py --model_dir work/tiny/run/hf --prompt "the red cat"
"""
import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--prompt", default="the")
    parser.add_argument("--max_new_tokens", type=int, default=20)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    transformers_logging.disable_progress_bar()  # its bar of the weights loaded
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    inputs = tokenizer(args.prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(f"prompt: {args.prompt!r}\ngenerated: {tokenizer.decode(output[0], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
