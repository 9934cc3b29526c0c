//! RoCEv2 framing of CM MADs (in progress).
