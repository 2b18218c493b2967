//! How a caller reacts to an error, decided in one place for every error the library returns:
//! retry (a server is unreachable), fix the configuration (no retry can help), or take the
//! refusal as the answer. The CLI turns the reaction into its exit code; long-running processes
//! retry the first kind and stop on the second.

pub use crate::error::Reaction;

/// How to react to `error`: decided by the first store, broker or configuration error in its
/// chain of causes; anything else is a refusal.
pub fn reaction(error: &(dyn std::error::Error + 'static)) -> Reaction {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(r) = own_reaction(e) {
            return r;
        }
        next = e.source();
    }
    Reaction::Refused
}

fn own_reaction(e: &(dyn std::error::Error + 'static)) -> Option<Reaction> {
    if let Some(e) = e.downcast_ref::<crate::store::Error>() {
        return Some(e.reaction());
    }
    if let Some(e) = e.downcast_ref::<crate::broker::Error>() {
        return Some(e.reaction());
    }
    if e.downcast_ref::<crate::config::Error>().is_some() {
        return Some(Reaction::Fix);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Report;

    #[derive(Debug, thiserror::Error)]
    #[error("the decision was not recorded")]
    struct Wrapper(#[source] crate::store::Error);

    #[test]
    fn a_wrapped_store_error_decides_the_reaction_and_prints_its_chain() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let down = crate::store::Error::unavailable("cannot reach Postgres", io);
        let e = Wrapper(down);
        assert_eq!(reaction(&e), Reaction::Retry);
        assert_eq!(
            Report(&e).to_string(),
            "the decision was not recorded: cannot reach Postgres: refused"
        );
        let plain = std::io::Error::other("bad input");
        assert_eq!(reaction(&plain), Reaction::Refused);
    }
}
