//! How a caller reacts to an error, decided in one place for every error the library returns:
//! retry (a server is unreachable), fix the configuration (no retry can help), or take the
//! refusal as the answer. The CLI turns the reaction into its exit code; long-running processes
//! retry the first kind and stop on the second.

use std::fmt;

/// What a caller does about an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reaction {
    /// A server is down or unreachable, or a connection broke: try again later.
    Retry,
    /// The configuration is wrong (a URL, a password, a missing database, vhost or schema): no
    /// retry helps until a person fixes it.
    Fix,
    /// The request was refused (a conflict, a stale fence, a decision that does not fit the run,
    /// bad input): the refusal is the answer.
    Refused,
}

/// A boxed cause, kept as the `source` of the error that wraps it.
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

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

/// Shows an error with its chain of causes on one line (`what: cause: cause`), for logs and
/// terminals: every error here keeps its cause as its `source` instead of printing it. A
/// driver's error (Postgres, RabbitMQ, I/O) ends the chain with the server's own words, without
/// the driver's repetitions and source positions.
pub struct Report<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut next = Some(self.0);
        let mut first = true;
        while let Some(e) = next {
            if !first {
                f.write_str(": ")?;
            }
            first = false;
            if let Some(words) = driver_words(e) {
                return f.write_str(&words);
            }
            write!(f, "{e}")?;
            next = e.source();
        }
        Ok(())
    }
}

/// What a driver's error says, in the server's words, if `e` is one.
fn driver_words(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    if let Some(e) = e.downcast_ref::<sqlx::Error>() {
        return Some(match e {
            sqlx::Error::Database(db) => db.message().to_owned(),
            sqlx::Error::Io(io) => io.to_string(),
            sqlx::Error::PoolTimedOut => {
                "no connection within the pool's timeout (the server is down, unreachable or out of connections)".into()
            }
            other => other.to_string(),
        });
    }
    if let Some(e) = e.downcast_ref::<lapin::Error>() {
        return Some(match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) => amqp.get_message().to_string(),
            lapin::ErrorKind::IOError(io) => io.to_string(),
            _ => e.to_string(),
        });
    }
    e.downcast_ref::<std::io::Error>().map(ToString::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

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
