//! `pvcm-lab`: the multi-VM lab.
//!
//! Not built yet (issue 6): hosts, VMs and the seed scenarios run end to end here.
