"""Bridges to the tools users already have (docs/integrations.md).

    hf_modeling   a `transformers` model class (`AutoModelForCausalLM`, trust_remote_code)
                  that runs an exported run through titanc's compiled program
    hf_export     `titanc export RUN --hf DIR`: the directory that class loads
    lm_eval       the `titanc` model of lm-evaluation-harness
    tensorboard   `train.tensorboard: DIR`: the trainer's metrics as TensorBoard scalars
    text          text in, text out over a run with a tokenizer

Each module imports its library (transformers, lm_eval, tensorboard) only when used, and a
missing one is a one-line TitancError naming the package to install.
"""
