"""Convert a Hugging Face model (a family of models/architecture.py, or one of models/layout.py HUB_LAYOUTS as the
hub ships it) to DeepSpeed per-layer pipeline files, and back.

  python convert2ckpt.py --model_name_or_path HF_DIR --output_dir DS_DIR [--tokenizer_name_or_path DIR] [--overwrite]
  python convert2ckpt.py --to_hf --ckpt_dir DS_DIR --output_dir HF_DIR [--tag TAG] [--max_shard_size 5GB]
  a LoRA checkpoint: --to_hf writes a peft adapter directory; add --merge_lora for the merged Hugging Face model
"""
import argparse
import os
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--to_hf", action="store_true", help="convert DeepSpeed layer files back to Hugging Face")
    parser.add_argument("--model_name_or_path", help="local Hugging Face model directory (HF -> DeepSpeed)")
    parser.add_argument("--ckpt_dir", help="DeepSpeed checkpoint directory holding 'latest' (DeepSpeed -> HF)")
    parser.add_argument("--tag", help="checkpoint tag to export (default: the one 'latest' names)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_shard_size", default="5GB", help="largest safetensors shard written by --to_hf")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output_dir")
    parser.add_argument("--tokenizer_name_or_path",
                        help="directory of the tokenizer to copy beside the layer files (default: the model's own)")
    parser.add_argument("--merge_lora", action="store_true",
                        help="--to_hf of a LoRA checkpoint: the base with its adapters merged, not the adapter")
    parser.add_argument("--skip_checksums", action="store_true",
                        help="--to_hf: export without checking the layer files against their checksums.json")
    args = parser.parse_args(argv)
    if args.to_hf and not args.ckpt_dir:
        parser.error("--to_hf needs --ckpt_dir")
    if not args.to_hf and not args.model_name_or_path:
        parser.error("--model_name_or_path is required (or --to_hf with --ckpt_dir)")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:  # each direction imports only what it needs: start-up is a visible share of converting a small model
        if args.to_hf:
            from checkpoints.ds_to_hf import convert_ds_to_hf
            out = convert_ds_to_hf(args.ckpt_dir, args.output_dir, args.tag, args.max_shard_size, args.overwrite,
                                   verify_checksums=not args.skip_checksums, merge_lora=args.merge_lora)
        else:
            from checkpoints.hf_to_ds import convert_hf_to_ds
            out = convert_hf_to_ds(args.model_name_or_path, args.output_dir, args.overwrite,
                                   args.tokenizer_name_or_path)
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        sys.exit(f"convert2ckpt: error: {error}")
    except Exception as error:  # torch.save's and safetensors' own words for a full disk: RuntimeError, SafetensorError
        from checkpoints.files import is_disk_full
        if not is_disk_full(error):
            raise
        sys.exit(f"convert2ckpt: error: {disk_full_message(args)}")
    print(f"wrote {out}")


def disk_full_message(args):
    """What to do when the output's disk filled up: the output directory is untouched (it is written into a
    staging sibling that is removed on failure), and the conversion needs about its input's weight bytes again."""
    from checkpoints.ds_to_hf import resolve_tag_dir
    from checkpoints.files import WEIGHT_SUFFIXES, free_bytes, size_text
    source = resolve_tag_dir(args.ckpt_dir, args.tag) if args.to_hf else args.model_name_or_path
    needed = sum(os.path.getsize(os.path.join(source, name)) for name in os.listdir(source)
                 if name.endswith(WEIGHT_SUFFIXES) and "optim_states" not in name and not name.startswith("mp_rank"))
    return (f"the disk of '{args.output_dir}' filled up: {size_text(free_bytes(args.output_dir))} free, the "
            f"converted weights need about {size_text(needed)}; nothing was written ('{args.output_dir}' is as it "
            f"was). Free space there or choose an --output_dir on a larger disk.")


if __name__ == "__main__":
    main()
