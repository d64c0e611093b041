"""CED + CSA2: retrofit a K/V projector (CED) and cross-layer K/V adapters (CSA2) onto a
pretrained hybrid LLM, and measure what they cost.  See README.md and docs/design.md."""

__version__ = "0.1.0"
