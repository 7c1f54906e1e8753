"""Front ends translate a protocol to `InferenceCall`s for the one dispatcher."""
