"""The computations behind the analyses, each on a model and token tensors, with no files,
options or tables: the logit and tuned lenses (``lens``), attention heads (``heads``), the
state across passes (``trajectory``), the feedback map's stability (``stability``),
activation patching (``patching``), attribution through the feedback loop (``attribution``,
``edges``), the channel while generating (``generation``) and answer accuracy per decoding
mode (``evaluate``)."""
