"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), answered through the
OpenAI chat path: requests, errors in Anthropic's shape, and the message events of a stream."""
