//! `pvcm-guest`: what runs inside the VM.
//!
//! Not built yet (issue 5): the driver-side virtqueue, the CM agent and the API.
