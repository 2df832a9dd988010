"""``python -m jax_cgx.bench <benchmark> [options]``."""

import argparse

from jax_cgx.bench import allreduce, codec, model, phases, scale


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jax_cgx.bench", description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    p = sub.add_parser("codec", help="quantize/dequantize throughput vs a plain copy", description=codec.__doc__)
    codec.add_arguments(p)
    p.set_defaults(run=codec.main)
    p = sub.add_parser(
        "allreduce", help="compressed_psum vs lax.psum over all local devices", description=allreduce.__doc__
    )
    allreduce.add_arguments(p)
    p.set_defaults(run=allreduce.main)
    p = sub.add_parser("model", help="predicted all-reduce times on a slow link (cost model)",
                       description=model.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model.add_arguments(p)
    p.set_defaults(run=model.main)
    p = sub.add_parser("phases", help="each phase of one compressed all-reduce timed alone",
                       description=phases.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    phases.add_arguments(p)
    p.set_defaults(run=phases.main)
    p = sub.add_parser("scale", help="the all-reduce predicted for many nodes of GPUs (cost model)",
                       description=scale.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    scale.add_arguments(p)
    p.set_defaults(run=scale.main)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
