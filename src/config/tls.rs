//! TLS to Postgres and RabbitMQ: the certificate files the settings name, read and checked when
//! the settings load (a missing, unreadable or empty file is named with the setting that names
//! it, before anything connects), and what a refused TLS handshake means, found in the driver's
//! error so that the store and the broker can say it in the words of their settings.

use std::fmt;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{AlertDescription, CertificateError};

/// What a certificate file must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pem {
    /// One or more PEM certificates (`-----BEGIN CERTIFICATE-----`): a CA, a client certificate.
    Certificates,
    /// One unencrypted PEM private key (PKCS#8, PKCS#1 or SEC1).
    PrivateKey,
}

/// A file named by a setting that cannot be used, with the setting, the file and why.
#[derive(Debug, thiserror::Error)]
#[error("{setting} names {path}, which {problem}")]
pub struct FileError {
    /// The setting or URL parameter that names the file (`broker.ca_file`, `DATABASE_URL sslrootcert`).
    pub setting: String,
    /// The file, as given.
    pub path: String,
    /// What is wrong with it.
    pub problem: String,
}

/// Reads the file `setting` names and checks that it holds `kind`; its bytes when it does.
pub fn read_pem(setting: &str, path: &str, kind: Pem) -> Result<Vec<u8>, FileError> {
    let refuse = |problem: String| FileError {
        setting: setting.to_owned(),
        path: path.to_owned(),
        problem,
    };
    let bytes = std::fs::read(path).map_err(|e| refuse(format!("cannot be read ({e})")))?;
    match kind {
        Pem::Certificates => {
            let mut count = 0;
            for cert in CertificateDer::pem_slice_iter(&bytes) {
                cert.map_err(|e| {
                    refuse(format!("holds a PEM certificate that does not parse ({e})"))
                })?;
                count += 1;
            }
            if count == 0 {
                return Err(refuse(
                    "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
                ));
            }
        }
        Pem::PrivateKey => {
            PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
                refuse(format!(
                    "holds no unencrypted PEM private key ({e}; an encrypted key must be decrypted first, e.g. with `openssl pkey`)"
                ))
            })?;
        }
    }
    Ok(bytes)
}

/// Why a server's TLS handshake was refused, as far as it concerns the operator; found by
/// [`refusal`] in a driver's error.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The server's certificate is not signed by a CA this client trusts.
    UnknownIssuer,
    /// The server's certificate does not name the host the client connected to.
    WrongName {
        /// The names the certificate holds (empty when the TLS stack did not say).
        presented: Vec<String>,
    },
    /// The server's certificate has expired.
    Expired,
    /// The server's certificate is not valid yet (or this machine's clock is behind).
    NotYetValid,
    /// Another problem with the server's certificate, in the TLS stack's words.
    BadCertificate(String),
    /// The server ended the handshake with this alert, e.g. it wants a client certificate or
    /// does not accept the one sent.
    ServerAlert(String),
}

impl Refusal {
    /// Whether the server asked for a client certificate that was not sent, or refused it.
    pub fn about_client_certificate(&self) -> bool {
        matches!(self, Self::ServerAlert(alert) if alert.contains("Certificate") || alert.contains("UnknownCA"))
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownIssuer => f.write_str("is not signed by a trusted CA"),
            Self::WrongName { presented } => write!(
                f,
                "does not name the host connected to{}",
                it_names(presented)
            ),
            Self::Expired => f.write_str("has expired"),
            Self::NotYetValid => {
                f.write_str("is not valid yet (or this machine's clock is behind)")
            }
            Self::BadCertificate(why) => write!(f, "was refused ({why})"),
            Self::ServerAlert(alert) => write!(f, "(alert {alert})"),
        }
    }
}

/// The TLS refusal behind `error`, if a certificate check or a server's alert is what failed:
/// looked for along its causes, including inside I/O errors, where the drivers keep it.
pub fn refusal(error: &(dyn std::error::Error + 'static)) -> Option<Refusal> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return classify(tls);
        }
        // `io::Error::source` skips the error it wraps, which is where a TLS failure sits.
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            && let Some(found) = refusal(inner)
        {
            return Some(found);
        }
        next = e.source();
    }
    None
}

fn classify(e: &rustls::Error) -> Option<Refusal> {
    match e {
        rustls::Error::InvalidCertificate(cert) => Some(match cert {
            CertificateError::UnknownIssuer => Refusal::UnknownIssuer,
            CertificateError::NotValidForName => Refusal::WrongName { presented: vec![] },
            CertificateError::NotValidForNameContext { presented, .. } => Refusal::WrongName {
                // The stack quotes each name ("DnsName(\"localhost\")"); the plain name reads better.
                presented: presented.iter().map(|n| plain_name(n)).collect(),
            },
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => Refusal::Expired,
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                Refusal::NotYetValid
            }
            other => Refusal::BadCertificate(format!("{other:?}")),
        }),
        rustls::Error::AlertReceived(alert) => Some(Refusal::ServerAlert(alert_name(*alert))),
        _ => None,
    }
}

/// ` (it names a, b)` for a certificate's names, to follow a host it does not name; empty when
/// the TLS stack did not say which it holds.
pub fn it_names(presented: &[String]) -> String {
    if presented.is_empty() {
        String::new()
    } else {
        format!(" (it names {})", presented.join(", "))
    }
}

/// `DnsName("localhost")` -> `localhost`, `IpAddress(127.0.0.1)` -> `127.0.0.1`.
fn plain_name(name: &str) -> String {
    match name.split_once('(') {
        Some((_, rest)) => rest.trim_end_matches(')').trim_matches('"').to_owned(),
        None => name.to_owned(),
    }
}

fn alert_name(alert: AlertDescription) -> String {
    format!("{alert:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_empty_file_is_named_with_its_setting() {
        let e = read_pem("broker.ca_file", "/nonexistent/ca.pem", Pem::Certificates).unwrap_err();
        let shown = e.to_string();
        assert!(
            shown.starts_with("broker.ca_file names /nonexistent/ca.pem, which cannot be read"),
            "{shown}"
        );
        let dir = std::env::temp_dir().join(format!("tm-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let path = empty.display().to_string();
        let cert = read_pem("broker.ca_file", &path, Pem::Certificates).unwrap_err();
        let key = read_pem("broker.client_key_file", &path, Pem::PrivateKey).unwrap_err();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            cert.to_string().contains("holds no PEM certificate"),
            "{cert}"
        );
        assert!(
            key.to_string().contains("no unencrypted PEM private key"),
            "{key}"
        );
    }

    #[test]
    fn a_refused_certificate_is_found_inside_the_io_error_that_carries_it() {
        let tls = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, tls);
        assert_eq!(refusal(&io), Some(Refusal::UnknownIssuer));
        let alert = rustls::Error::AlertReceived(AlertDescription::CertificateRequired);
        let found = refusal(&std::io::Error::other(alert)).unwrap();
        assert!(found.about_client_certificate(), "{found}");
        let plain = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(refusal(&plain), None);
        assert_eq!(plain_name("DnsName(\"localhost\")"), "localhost");
        assert_eq!(plain_name("IpAddress(127.0.0.1)"), "127.0.0.1");
    }
}
