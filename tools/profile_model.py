#!/usr/bin/env python
"""Parameters and forward FLOPs of a config's model at its own geometry, without a data set.

    python tools/profile_model.py --hypes_yaml hypes_yaml/opv2v/point_pillar_attfuse.yaml
"""
import argparse

from opencood.config import ConfigError, load_config
from opencood.data.pipeline import BatchPreparer
from opencood.models.build import build_model
from opencood.utils.fake_batch import fake_collated_batch
from opencood.utils.model_stats import count_flops, count_parameters


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hypes_yaml", required=True)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--agents", type=int, default=3, help="agents per sample (intermediate)")
    parser.add_argument("--pillars", type=int, default=16000, help="non-empty pillars per agent")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.hypes_yaml, args.overrides)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None
    model = build_model(cfg["model"]).eval()
    single = cfg["model"]["core_method"] == "point_pillar"
    batch = fake_collated_batch(cfg, args.batch_size, args.agents, args.pillars,
                                single_agent=single)
    inputs = BatchPreparer.from_config(cfg, "cpu").model_inputs(batch)
    total, trainable = count_parameters(model)
    flops = count_flops(model, inputs)
    agents = 1 if single else args.agents
    print(f"{cfg['model']['core_method']} ({args.hypes_yaml})")
    print(f"  parameters: {total / 1e6:.3f} M ({trainable / 1e6:.3f} M trainable)")
    print(f"  forward: {flops / 1e9:.2f} GFLOPs for batch {args.batch_size} x {agents} agent(s), "
          f"{args.pillars} pillars per agent; forward+backward is about 3x: "
          f"{3 * flops / 1e12:.3f} TFLOPs")
    return total, flops


if __name__ == "__main__":
    main()
