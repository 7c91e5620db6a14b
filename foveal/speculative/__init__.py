"""Speculative decoding: proposers and lossless verification. A proposer guesses a request's next few
tokens cheaply (ngram: from the request's own earlier text), the target model scores them all in one
forward pass, and rejection.verify keeps what the target agrees with, so the output is distributed
exactly as plain decoding's."""
