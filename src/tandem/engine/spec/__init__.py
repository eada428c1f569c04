"""Speculative decoding's scheduling side (no torch): n-gram proposals, acceptance, the step cost
model, the per-step draft plan and the guard that turns speculation off where it does not pay."""
