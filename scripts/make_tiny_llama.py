"""Make the embedded tiny default from nothing: a generated text corpus, a SentencePiece tokenizer trained on it,
and a randomly initialised tiny LLaMA saved in Hugging Face format (nothing is downloaded).

  python scripts/make_tiny_llama.py --output_dir work/tiny
writes work/tiny/{train.txt, eval.txt, hf/}.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

from data.corpus import train_demo_tokenizer, write_demo_corpus  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="work/tiny")
    parser.add_argument("--train_lines", type=int, default=20000)
    parser.add_argument("--eval_lines", type=int, default=500)
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hf_dir = os.path.join(args.output_dir, "hf")
    train_path = write_demo_corpus(os.path.join(args.output_dir, "train.txt"), args.train_lines, args.seed)
    write_demo_corpus(os.path.join(args.output_dir, "eval.txt"), args.eval_lines, args.seed + 1)
    tokenizer = train_demo_tokenizer(train_path, hf_dir, args.vocab_size)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size,
                         intermediate_size=args.hidden_size * 8 // 3 // 8 * 8, num_hidden_layers=args.num_hidden_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    transformers_logging.disable_progress_bar()  # its bar of one shard
    LlamaForCausalLM(config).save_pretrained(hf_dir)
    print(f"wrote {args.output_dir}/train.txt, eval.txt and the Hugging Face model {hf_dir}")


if __name__ == "__main__":
    main()
