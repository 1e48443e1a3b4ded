# Multi-stage build of the one csi-sidecars image: a static binary on distroless, run as
# non-root. Vendors run it once per sidecar container: `csi-sidecars attacher ...`.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/csi-sidecars ./cmd/csi-sidecars

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/csi-sidecars /csi-sidecars
USER 65532:65532
ENTRYPOINT ["/csi-sidecars"]
