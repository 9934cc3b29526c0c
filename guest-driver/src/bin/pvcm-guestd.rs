//! `pvcm-guestd`: the guest CM service. It serves the Linux rdma_cm device through
//! CUSE so the distribution's librdmacm programs run unchanged in a pvcm VM; the
//! service lives in the library ([`pvcm_guest::service`]).

fn main() -> std::process::ExitCode {
    pvcm_guest::service::cli::main()
}
