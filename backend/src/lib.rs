//! `pvcm-backend`: the host side of pvcm.
//!
//! Not built yet: the multiplexer (issue 3) and the vhost-user daemon (issue 4) land here.
